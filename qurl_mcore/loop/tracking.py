"""Per-step metrics: appended to `metrics.jsonl` (the record the report and a resumed run read), mirrored to
TensorBoard, and to Weights & Biases when a project is configured. And the run's log files: every process of
a run writes what it prints (third-party warnings included) to its own file in `logging.dir`, so that the
console keeps the progress bar and qurl's own one-line events."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path


def redirect_output(path: str | Path) -> Path:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so child processes and C libraries
    too) to the end of `path`. For the run's actors, whose output nobody watches live."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def warnings_to_file(path: str | Path) -> logging.Handler:
    """Route Python warnings of this process to `path` instead of the console; returns the handler (remove
    it from the `py.warnings` logger to undo)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    logger = logging.getLogger("py.warnings")
    logger.addHandler(handler)
    logger.propagate = False
    logging.captureWarnings(True)
    return handler


class MetricsLog:
    def __init__(self, log_dir: str | Path, *, wandb_project: str = "", run_config: dict | None = None):
        # lazy: loads torch; `qurl --help` imports this module (through compare.py)
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            import wandb  # optional: only installed where it is used; the API key comes from the environment

            self._wandb = wandb.init(project=wandb_project, config=run_config or {}, dir=str(self.dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step. A resumed run first drops records past its checkpoint (`truncate`)."""
        clean = {k: float(v) for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else None) for k, v in clean.items()}})
                    + "\n")
        for key, value in clean.items():
            if math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def truncate(self, last_step: int) -> None:
        """Forget records after `last_step` (steps a crashed run did after its last checkpoint)."""
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= last_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
