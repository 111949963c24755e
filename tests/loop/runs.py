"""`qurl train` runs for the end-to-end tests: a tiny config run in a process of its own (which starts its own
local Ray cluster), and what it logged and saved."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from qurl_mcore.checkpoint import latest_checkpoint, model_tensors, read_meta

TINY = ["data.prompts_per_step=2", "data.num_prompts=16", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=6", "rollout.context_length=256", "rollout.max_total_tokens=2048",
        "train.micro_batch_size=4", "train.lr=1e-4", "logging.progress=false", "checkpoint.every=1",
        "train.threads=2"]
GREEDY = ["rollout.top_k=1", "train.entropy_coef=0.01"]


def command(run_dir: Path, *overrides: str) -> list[str]:
    """`qurl train` of the tiny config with its checkpoints and logs under `run_dir`."""
    return [sys.executable, "-m", "qurl_mcore", "train", f"checkpoint.dir={run_dir}/ckpt",
            f"logging.dir={run_dir}/logs", *TINY, *overrides]


def start(run_dir: Path, *overrides: str, own_group: bool = False) -> subprocess.Popen:
    """The run started, its output appended to `run_dir/out.log`; never sent to a Ray cluster of the caller's.
    `own_group`: the run leads a process group of its own, as a scheduler's job step does (`os.killpg`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen(command(run_dir, *overrides), stdout=open(run_dir / "out.log", "ab"),
                            stderr=subprocess.STDOUT, env=env, process_group=0 if own_group else None)


def train(run_dir: Path, *overrides: str, timeout: float = 600) -> str:
    """The run to its end, which must be a success; returns its output."""
    process = start(run_dir, *overrides)
    code = process.wait(timeout=timeout)
    out = (run_dir / "out.log").read_text()
    assert code == 0, out[-4000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    """The rows of the run's metrics.jsonl so far (one a step, and the held-out evaluations)."""
    path = run_dir / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(run_dir: Path, process: subprocess.Popen, step: int, timeout: float = 400) -> None:
    """Until the run has logged `step` rows; fails with its output if it ends or stalls first."""
    deadline = time.monotonic() + timeout
    while len(metrics(run_dir)) < step:
        assert process.poll() is None, (run_dir / "out.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.5)


def assert_code_pushes(run_dir: Path, *overrides: str) -> None:
    """Every step of the run (of these overrides) pushed codes: the bytes the plan gives for its code push
    (`sizing.push_bytes`, fewer than a BF16 push's), and the refit check compared every unit the engine
    quantizes and found it equal (`rollout.verify_push`)."""
    from qurl_mcore.config import load_config
    from qurl_mcore.models import resolve_model_path
    from qurl_mcore.models.registry import shape
    from qurl_mcore.rollout.codes import engine_units
    from qurl_mcore.sizing import model_config, push_bytes

    cfg = load_config(None, [*TINY, *overrides])
    s = shape(model_config(cfg.model.path)[0])
    planned = push_bytes(s, cfg)
    assert planned["codes"] and cfg.push_mode(s) == "codes"
    bf16 = push_bytes(s, load_config(None, [*TINY, *overrides, "rollout.push=bf16"]))["bytes"]
    units = set(engine_units(resolve_model_path(cfg.model.path), cfg.recipe().engine.groups).values())
    for r in metrics(run_dir):
        assert r["push/bytes"] == planned["bytes"] < bf16, r["step"]
        assert r["push/verified_units"] == len(units), r["step"]


def model_state(run_dir: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """The step and the model tensors of the run's newest checkpoint that verifies."""
    path = latest_checkpoint(run_dir / "ckpt")
    return read_meta(path)["step"], model_tensors(path)
