"""Render (and submit) the Slurm job that runs a qurl training job on a Ray cluster spanning its nodes.

The job (launch/slurm/job.sbatch.j2): the first node runs the Ray head, the others join as workers through
`srun`; every node is tagged with Ray resources `qurl_train` and/or `qurl_rollout` (colocated: both on every
node; disaggregated: the first `nodes - rollout_nodes` nodes train, the rest roll out); after all nodes have
joined, `qurl train` runs on the head node. SIGTERM (preemption) and USR1 (shortly before the time limit)
make the trainer checkpoint; after USR1 the job requeues itself and resumes from its checkpoint directory.
"""
from __future__ import annotations

import math
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .config import ConfigError, load_config
from .models import resolve_model_path
from .placement import placement_of

LAYOUTS = ("colocated", "disaggregated")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: the checkout this package runs from: the job runs its launch/ scripts by their absolute paths
CHECKOUT = Path(__file__).resolve().parent.parent
TEMPLATE = CHECKOUT / "launch" / "slurm" / "job.sbatch.j2"
RAY_SCRIPT = CHECKOUT / "launch" / "ray_cluster.sh"


def running_environment() -> str:
    """The Python environment this process runs in, when it is one to activate (a virtual environment or a conda
    environment), else ''."""
    prefix = Path(sys.prefix)
    return str(prefix) if sys.prefix != sys.base_prefix or (prefix / "conda-meta").is_dir() else ""


def _outermost(paths: list[Path]) -> list[Path]:
    """`paths` without those inside another of them, sorted."""
    kept: list[Path] = []
    for path in sorted(set(paths)):
        if not any(path == k or k in path.parents for k in kept):
            kept.append(path)
    return kept

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
    """Everything a rendered job depends on; `validate` explains any bad value. `layout`, `rollout_nodes` and
    `job_name` left out come from the config (`resolved`)."""

    nodes: int
    gpus_per_node: int
    config: str
    overrides: list[str] = field(default_factory=list)
    workdir: str = "."
    layout: str | None = None
    rollout_nodes: int | None = None
    job_name: str | None = None
    gpu: str | None = None  # the kind of GPU the memory is planned for (a key of sizing.GPUS)
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
        """A copy with absolute paths and the defaults that depend on other fields filled in: the job name from
        the config file's name; the run's directories the config's checkpoint.dir and logging.dir (with the
        overrides; relative ones under the work directory, where `qurl train` runs); the environment this
        command runs from (none with a container: the image's); the container mounts every directory the config
        names; the layout from the config, and a disaggregated job's rollout nodes as many as its engines fill."""
        workdir = Path(self.workdir).resolve()
        if self.venv is not None:
            venv = self.venv
        else:
            venv = "" if self.container_image else running_environment()
        job_name = self.job_name or Path(self.config).stem
        layout, rollout_nodes = self.layout, self.rollout_nodes
        cfg = self._config() if not self.command else None
        ckpt_dir = self.ckpt_dir or (cfg.checkpoint.dir if cfg else str(workdir / "runs" / job_name / "checkpoints"))
        log_dir = self.log_dir or (cfg.logging.dir if cfg else str(workdir / "runs" / job_name / "logs"))
        ckpt_dir, log_dir = (str(workdir / Path(d).expanduser()) for d in (ckpt_dir, log_dir))
        mounts = self.container_mounts or ",".join(
            f"{p}:{p}" for p in _outermost([workdir, CHECKOUT, Path(self.config).resolve().parent, Path(ckpt_dir),
                                            Path(log_dir), *self._config_dirs(cfg, workdir)]))
        if cfg is not None and layout is None:
            layout = cfg.layout
        if cfg is not None and rollout_nodes is None and layout == "disaggregated":
            try:
                rollout_nodes = self._nodes_needed(cfg)[1]
            except ValueError:  # validate says why
                pass
        return replace(
            self,
            workdir=str(workdir),
            job_name=job_name,
            layout=layout or "colocated",
            rollout_nodes=rollout_nodes or 0,
            venv=str(Path(venv).expanduser().absolute()) if venv else "",
            log_dir=str(Path(log_dir).resolve()),
            ckpt_dir=str(Path(ckpt_dir).resolve()),
            config=str(Path(self.config).resolve()),
            container_mounts=mounts,
            env={**(GPU_ENV if self.gpus_per_node else CPU_ENV), **self.env},
        )

    @staticmethod
    def _config_dirs(cfg, workdir: Path) -> list[Path]:
        """The directories of the files a run reads that the config names (prompts, held-out prompts, the model and
        a checkpoint it starts from), as absolute paths; a packaged model's name resolves to its cache."""
        if cfg is None:
            return []
        files = [cfg.data.path if cfg.data.task == "file" else "", cfg.eval.data]
        dirs = [cfg.model.load]
        try:
            dirs.append(str(resolve_model_path(cfg.model.path)))
        except (OSError, ValueError):  # not on this machine: its own path, when it is one
            dirs.append(cfg.model.path if "/" in cfg.model.path else "")
        out = [(workdir / Path(f).expanduser()).parent for f in files if f]
        return out + [workdir / Path(d).expanduser() for d in dirs if d]

    @property
    def venv_variable(self) -> str:
        """The variable that names an activated environment of `venv`'s kind: conda's or a virtual one's."""
        return "CONDA_PREFIX" if (Path(self.venv) / "conda-meta").is_dir() else "VIRTUAL_ENV"

    def train_command(self) -> str:
        """The shell command run on the head node: `qurl train` on the config, checkpointing to ckpt_dir
        (which is also where a requeued job resumes from) and logging to log_dir, beside Slurm's and Ray's."""
        if self.command:
            return self.command
        return shlex.join(["qurl", "train", "--config", self.config, *self._train_overrides()])

    def validate(self) -> None:
        errors = []
        if self.nodes < 1:
            errors.append(f"--nodes must be at least 1 (got {self.nodes})")
        if self.gpus_per_node < 0:
            errors.append(f"--gpus-per-node must be 0 or more (got {self.gpus_per_node})")
        if self.cpus_per_node < 1:
            errors.append(f"--cpus-per-node must be at least 1 (got {self.cpus_per_node})")
        if self.layout is not None and self.layout not in LAYOUTS:
            errors.append(f"--layout must be one of {list(LAYOUTS)} (got {self.layout!r})")
        if self.layout and any(o.startswith("layout=") and o != f"layout={self.layout}" for o in self.overrides):
            errors.append(f"--layout {self.layout} tags each node for that layout, where a run of another layout "
                          "cannot be placed; drop the layout= override")
        if self.job_name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", self.job_name):
            errors.append(f"--job-name may hold letters, digits, '_', '.', '-' only (got {self.job_name!r})")
        if self.time and not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", self.time):
            errors.append(f"--time must be a Slurm time such as 04:00:00 or 2-00:00:00 (got {self.time!r})")
        if not self.command and not Path(self.config).is_file():
            errors.append(f"--config {self.config}: no such file")
        missing = [str(p) for p in (TEMPLATE, RAY_SCRIPT) if not p.is_file()]
        if missing:
            errors.append(f"{', '.join(missing)}: not found; the job runs the checkout's launch/ scripts: install "
                          "qurl-mcore from its checkout (pip install -e CHECKOUT)")
        if self.venv and not self.container_image and not (Path(self.venv).expanduser() / "bin" / "python").exists():
            errors.append(f"--venv {self.venv}: no Python environment there (no bin/python); give the environment "
                          "qurl-mcore is installed in, or --venv '' for the one on the nodes' PATH")
        for key in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                errors.append(f"--env {key!r} is not a valid variable name")
        for name, value in self._texts():
            if _CONTROL.search(value):
                errors.append(f"{name} {value!r} holds a control character (a newline would start a line of "
                              "its own in the job script); remove it")
        if not errors and self.nodes >= 1 and self.gpus_per_node >= 0:
            errors += self.resolved()._layout_problems()
        if not errors and not self.command:
            errors += self.resolved()._run_problems()
        if errors:
            raise ValueError("invalid Slurm job:\n  " + "\n  ".join(errors))

    def _layout_problems(self) -> list[str]:
        """The node split of the (resolved) layout."""
        if self.layout == "disaggregated" and not 1 <= self.rollout_nodes < self.nodes:
            return [f"a disaggregated layout needs 1 <= --rollout-nodes < --nodes, so that both training and "
                    f"rollout get nodes (got {self.rollout_nodes} of {self.nodes})"]
        if self.layout == "colocated" and self.rollout_nodes:
            return ["--rollout-nodes only applies to --layout disaggregated (or a config of that layout)"]
        return []

    def _texts(self) -> list[tuple[str, str]]:
        """(option, value) of every text that reaches the rendered script."""
        out = [(f"--{f.name.replace('_', '-')}", getattr(self, f.name)) for f in fields(self)
               if isinstance(getattr(self, f.name), str)]
        out += [("override", o) for o in self.overrides]
        out += [(f"--env {k}=", v) for k, v in self.env.items()]
        return out

    def _train_overrides(self) -> list[str]:
        """The key=value arguments of the job's `qurl train`: the run's directories, and the layout the nodes are
        tagged for (a run of another layout would wait for its placement, then fail), before the user's."""
        dirs = [f"{key}={value}" for key, value in (("checkpoint.dir", self.ckpt_dir), ("logging.dir", self.log_dir))
                if value]
        return [*dirs, *([f"layout={self.layout}"] if self.layout else []), *self.overrides]

    def _load(self):
        return load_config(self.config if Path(self.config).is_file() else None, self._train_overrides())

    def _config(self):
        """The config with the job's overrides (None when it does not load: `validate` says why)."""
        try:
            return self._load()
        except ConfigError:
            return None

    def _run_problems(self) -> list[str]:
        """The run as `qurl train --check` and `qurl plan` check it (a resolved job): the config with the job's
        overrides (schema, types, ranges: a typo fails here, not on the cluster), the rules between fields, the
        model, the memory on `gpu`, and the config's placement on the job's nodes."""
        # lazy: loads torch; `qurl --help` imports this module
        from .preflight import preflight

        try:
            cfg = self._load()
        except ConfigError as err:
            return [f"qurl train would refuse: {problem}" for problem in err.problems]
        try:
            checked = preflight(cfg, use_gpu=self.gpus_per_node > 0, gpu=self.gpu or cfg.gpu or None)
        except ValueError as err:  # an unknown --gpu
            return [str(err)]
        problems = [f"qurl train --check would refuse: {p}" for p in checked.problems]
        # placement_of's own refusals are preflight's too: said once
        return problems + [p for p in self._placement_problems(cfg)
                           if not any(p.removeprefix("placement: ") in q for q in problems)]

    def _per_node(self) -> str:
        return (f"{self.gpus_per_node} GPUs and " if self.gpus_per_node else "") + f"{self.cpus_per_node} CPUs"

    def _nodes_needed(self, cfg) -> tuple[int, int]:
        """(training nodes, rollout nodes) the config's placement (`placement.placement_of`) fills on nodes of
        this job's GPUs and CPUs; colocated: (nodes, 0). Raises ValueError when a bundle fits no node."""
        use_gpu = self.gpus_per_node > 0
        p = placement_of(cfg, use_gpu)
        node = {"CPU": self.cpus_per_node, **({"GPU": self.gpus_per_node} if use_gpu else {})}

        def nodes_for(indices: list[int]) -> int:
            if not indices:
                return 0
            bundle = p.bundles[indices[0]]  # a side's bundles are all alike
            fit = min(int(node[k] // v) for k, v in bundle.items() if k in node and v)
            if not fit:
                raise ValueError(f"a bundle of {bundle} fits no node of {self._per_node()}; lower "
                                 "rollout.tp_size, or give nodes with more GPUs (--gpus-per-node)")
            return math.ceil(len(indices) / fit)

        return nodes_for(p.trainer), 0 if cfg.layout == "colocated" else nodes_for(p.engines)

    def _placement_problems(self, cfg) -> list[str]:
        """Whether the job's nodes hold the config's placement (a resolved job), with the nodes that would."""
        try:
            train, rollout = self._nodes_needed(cfg)
        except ValueError as err:
            return [f"placement: {err}"]
        per_node = self._per_node()
        if cfg.layout == "colocated" and train > self.nodes:
            return [f"placement: the config's {cfg.train.world_size} trainer rank(s) with their engines need "
                    f"{train} node(s) of {per_node}, the job has {self.nodes}; use --nodes {train}, or lower "
                    "train.dp_size / train.tp_size / train.pp_size"]
        if cfg.layout == "disaggregated" and (train > self.train_nodes or rollout > self.rollout_nodes):
            return [f"placement: the config's {cfg.train.world_size} trainer rank(s) need {train} training node(s) "
                    f"and its {cfg.rollout.engines} engine(s) of TP {cfg.rollout.tp_size} {rollout} rollout "
                    f"node(s) of {per_node}, the job has {self.train_nodes} and {self.rollout_nodes}; use "
                    f"--nodes {train + rollout} --rollout-nodes {rollout}, or lower train.dp_size / rollout.engines"]
        return []

    @property
    def train_nodes(self) -> int:
        return self.nodes - (self.rollout_nodes or 0) if self.layout == "disaggregated" else self.nodes


def render(job: SlurmJob) -> str:
    """The sbatch script for `job` (validated, with defaults resolved)."""
    # lazy: keeps `qurl --help` fast, which imports this module
    import jinja2

    job.validate()
    job = job.resolved()
    # bash uses "{#" (${#array[@]}), so Jinja comments get other delimiters
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
                             comment_start_string="{##", comment_end_string="##}")
    env.filters["q"] = lambda value: shlex.quote(str(value))
    template = env.from_string(TEMPLATE.read_text())
    fields = {**job.__dict__, "command": job.train_command()}
    return template.render(**fields, train_nodes=job.train_nodes, exclusive=job.gpus_per_node > 0,
                           venv_variable=job.venv_variable, ray_script=str(RAY_SCRIPT))


def submit(job: SlurmJob) -> tuple[Path, str]:
    """Write the script next to the job's logs and `sbatch` it; returns (script path, job id)."""
    script = render(job)
    job = job.resolved()
    path = Path(job.log_dir) / f"{job.job_name}.sbatch"
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RuntimeError("sbatch is not on PATH: run qurl launch slurm on a Slurm login node, or with --dry-run to "
                           "print the job script")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    out = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"sbatch refused {path}: {out.stderr.strip()}")
    return path, out.stdout.strip().split(";")[0]
