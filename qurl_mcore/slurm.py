"""Render (and submit) the Slurm job that runs a qurl training job on a Ray cluster spanning its nodes.

The job (launch/slurm/job.sbatch.j2): the first node runs the Ray head, the others join as workers through
`srun`; every node is tagged with Ray resources `qurl_train` and/or `qurl_rollout` (colocated: both on every
node; disaggregated: the first `nodes - rollout_nodes` nodes train, the rest roll out); after all nodes have
joined, `qurl train` runs on the head node. SIGTERM (preemption) and USR1 (shortly before the time limit)
make the trainer checkpoint; after USR1 the job requeues itself and resumes from its checkpoint directory.
"""
from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

LAYOUTS = ("colocated", "disaggregated")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
TEMPLATE = Path(__file__).resolve().parent.parent / "launch" / "slurm" / "job.sbatch.j2"

#: Environment for NCCL over InfiniBand and for Megatron on GPUs. Site-specific settings (NCCL_IB_HCA,
#: NCCL_SOCKET_IFNAME, ...) are added with --env.
GPU_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # Megatron's TP/SP communication overlap needs ordered kernels
    "NCCL_IB_DISABLE": "0",
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "PYTHONUNBUFFERED": "1",
}
CPU_ENV = {"PYTHONUNBUFFERED": "1"}


@dataclass
class SlurmJob:
    """Everything a rendered job depends on; `validate` explains any bad value."""

    nodes: int
    gpus_per_node: int
    config: str
    overrides: list[str] = field(default_factory=list)
    workdir: str = "."
    layout: str = "colocated"
    rollout_nodes: int = 0
    job_name: str = "qurl"
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    cpus_per_node: int = 16
    container_image: str | None = None
    container_mounts: str | None = None
    venv: str | None = None
    log_dir: str | None = None
    ckpt_dir: str | None = None
    ray_port: int = 6379
    dashboard_port: int = 8265
    object_store_bytes: int = 10 * 2**30
    ready_timeout_s: int = 600
    requeue_grace_s: int = 180
    env: dict[str, str] = field(default_factory=dict)
    command: str | None = None

    def resolved(self) -> "SlurmJob":
        """A copy with absolute paths and the defaults that depend on other fields filled in."""
        workdir = Path(self.workdir).resolve()
        venv = self.venv if self.venv is not None else (str(workdir / ".venv") if (workdir / ".venv").is_dir() else "")
        run_dir = workdir / "runs" / self.job_name
        return replace(
            self,
            workdir=str(workdir),
            venv=str(Path(venv).resolve()) if venv else "",
            log_dir=str(Path(self.log_dir or run_dir / "logs").resolve()),
            ckpt_dir=str(Path(self.ckpt_dir or run_dir / "checkpoints").resolve()),
            config=str(Path(self.config).resolve()),
            container_mounts=self.container_mounts or f"{workdir}:{workdir}",
            env={**(GPU_ENV if self.gpus_per_node else CPU_ENV), **self.env},
        )

    def train_command(self) -> str:
        """The shell command run on the head node: `qurl train` on the config, checkpointing to ckpt_dir
        (which is also where a requeued job resumes from)."""
        if self.command:
            return self.command
        # a disaggregated job tags each node for training or for rollout only: a colocated run (the config's
        # default) finds no node with both and gives up after the placement timeout
        layout = ["layout=disaggregated"] if self.layout == "disaggregated" else []
        args = ["qurl", "train", "--config", self.config, f"checkpoint.dir={self.ckpt_dir}", *layout, *self.overrides]
        return shlex.join(args)

    def validate(self) -> None:
        errors = []
        if self.nodes < 1:
            errors.append(f"--nodes must be at least 1 (got {self.nodes})")
        if self.gpus_per_node < 0:
            errors.append(f"--gpus-per-node must be 0 or more (got {self.gpus_per_node})")
        if self.cpus_per_node < 1:
            errors.append(f"--cpus-per-node must be at least 1 (got {self.cpus_per_node})")
        if self.layout not in LAYOUTS:
            errors.append(f"--layout must be one of {list(LAYOUTS)} (got {self.layout!r})")
        if self.layout == "disaggregated" and not 1 <= self.rollout_nodes < self.nodes:
            errors.append(f"a disaggregated layout needs 1 <= --rollout-nodes < --nodes, so that both training "
                          f"and rollout get nodes (got {self.rollout_nodes} of {self.nodes})")
        if self.layout == "disaggregated" and any(o.startswith("layout=") and o != "layout=disaggregated"
                                                  for o in self.overrides):
            errors.append("--layout disaggregated tags each node for training or rollout only, where a colocated "
                          "run cannot be placed; drop the layout= override")
        if self.layout == "colocated" and self.rollout_nodes:
            errors.append("--rollout-nodes only applies to --layout disaggregated")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.job_name):
            errors.append(f"--job-name may hold letters, digits, '_', '.', '-' only (got {self.job_name!r})")
        if self.time and not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", self.time):
            errors.append(f"--time must be a Slurm time such as 04:00:00 or 2-00:00:00 (got {self.time!r})")
        if not self.command and not Path(self.config).is_file():
            errors.append(f"--config {self.config}: no such file")
        for key in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                errors.append(f"--env {key!r} is not a valid variable name")
        for name, value in self._texts():
            if _CONTROL.search(value):
                errors.append(f"{name} {value!r} holds a control character (a newline would start a line of "
                              "its own in the job script); remove it")
        if not self.command:
            errors += self._override_problems()
        if errors:
            raise ValueError("invalid Slurm job:\n  " + "\n  ".join(errors))

    def _texts(self) -> list[tuple[str, str]]:
        """(option, value) of every text that reaches the rendered script."""
        out = [(f"--{f.name.replace('_', '-')}", getattr(self, f.name)) for f in fields(self)
               if isinstance(getattr(self, f.name), str)]
        out += [("override", o) for o in self.overrides]
        out += [(f"--env {k}=", v) for k, v in self.env.items()]
        return out

    def _override_problems(self) -> list[str]:
        """The overrides checked as `qurl train` will check them, with the config file (schema, types,
        ranges): a typo fails here, not on the cluster."""
        from .config import ConfigError, load_config

        try:
            load_config(self.config if Path(self.config).is_file() else None, self.overrides)
        except ConfigError as err:
            return [f"qurl train would refuse: {problem}" for problem in err.problems]
        return []

    @property
    def train_nodes(self) -> int:
        return self.nodes - self.rollout_nodes if self.layout == "disaggregated" else self.nodes


def render(job: SlurmJob) -> str:
    """The sbatch script for `job` (validated, with defaults resolved)."""
    import jinja2

    job.validate()
    job = job.resolved()
    # bash uses "{#" (${#array[@]}), so Jinja comments get other delimiters
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
                             comment_start_string="{##", comment_end_string="##}")
    env.filters["q"] = lambda value: shlex.quote(str(value))
    template = env.from_string(TEMPLATE.read_text())
    fields = {**job.__dict__, "command": job.train_command()}
    return template.render(**fields, train_nodes=job.train_nodes, exclusive=job.gpus_per_node > 0)


def submit(job: SlurmJob) -> tuple[Path, str]:
    """Write the script next to the job's logs and `sbatch` it; returns (script path, job id)."""
    script = render(job)
    job = job.resolved()
    path = Path(job.log_dir) / f"{job.job_name}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"sbatch refused {path}: {out.stderr.strip()}")
    return path, out.stdout.strip().split(";")[0]
