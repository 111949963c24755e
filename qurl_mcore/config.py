"""The training job's configuration: one YAML file plus `key=value` overrides, checked field by field.

Every bad field is reported at once, each with its dotted name, what was given and what is allowed, so a user
fixes a config in one round.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from qurl_mcore.precision import FP4_FORMATS, PRECISIONS, SCOPES, get_precision, select, uaq_scope
from qurl_mcore.rl import AGGREGATIONS, KL_ESTIMATORS, LOSSES
from qurl_mcore.tasks import DOTTED, REWARDS

if TYPE_CHECKING:
    from qurl_mcore.models.slots import Shape

# torch and yaml are imported in the functions that use them: `qurl --help` builds its parser from modules that
# import this one, and stays fast without them

# the choices of the tables (precisions: qurl_mcore/precision.py, losses: qurl_mcore/rl, rewards:
# qurl_mcore/tasks/rewards.py), as types the field checks read
PrecisionName = Literal[tuple(PRECISIONS)]  # type: ignore[valid-type]
ScopeName = Literal[("auto", *SCOPES)]  # type: ignore[valid-type]
FP4Format = Literal[FP4_FORMATS]  # type: ignore[valid-type]
LossName = Literal[LOSSES]  # type: ignore[valid-type]
Aggregation = Literal[AGGREGATIONS]  # type: ignore[valid-type]
KLEstimator = Literal[KL_ESTIMATORS]  # type: ignore[valid-type]

@dataclass
class ModelConfig:
    path: str = "smollm2"  # an HF checkpoint directory, or "smollm2" for the packaged SmolLM2-135M-Instruct
    # a torch_dist checkpoint whose weights replace path's at the start (a Megatron-LM or slime --save directory,
    # one of its iter_* directories, or a run's step_N/trainer); path still gives the architecture and tokenizer
    load: str = ""


@dataclass
class DataConfig:
    task: Literal["addition", "file"] = "addition"
    path: str = ""  # .jsonl or .parquet, for task "file"
    prompt_key: str = "question"
    answer_key: str = "answer"
    reward: str = "first_number"  # a name of tasks.REWARDS, or package.module:function (tasks/rewards.py)
    system_prompt: str = ""  # prepended to every prompt when set
    prompts_per_step: int = 8
    num_prompts: int = 512  # size of the generated set for task "addition"
    min_operand: int = 0  # task "addition": operands min_operand..max_operand (tasks/synthetic.py on 0)
    max_operand: int = 9


@dataclass
class RolloutConfig:
    samples_per_prompt: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    engines: int = 1
    tp_size: int = 1
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    context_length: int = 2048
    max_total_tokens: int = 0  # KV-cache size per engine; 0: SGLang sizes it from free memory
    mem_fraction: float = 0.0  # of each GPU, SGLang's weights + KV cache (mem_fraction_static); 0: SGLang's default
    offload: Literal["auto", True, False] = "auto"  # engines release their GPU memory while the trainer steps
    push_bucket_mb: int = 512  # bound on one weight-push bucket
    requant: Literal["eager", "compiled"] = "eager"  # engines' re-quantization per push; compiled: torch.compile'd
    # what a push to quantized engines carries: codes (the trainer's codes and scales, no masters in the engines),
    # bf16 (full precision, re-quantized by the engines), auto: codes where they serve (`Config.push_mode`: both
    # layouts, all but NVFP4 attention whose k/v heads TP ranks replicate), which the shipped configs take; bf16
    # stays the default until a code push's time goals hold for every format (docs/rollout.md, "Code pushes")
    push: Literal["auto", "codes", "bf16"] = "bf16"
    verify_push: bool = True  # after each push, compare the engines' installed codes with the trainer's (digests)
    # SmoothQuant migration strength α of the engines' copy (qurl_mcore/smoothing.py); 0: off
    smoothing: float = 0.0
    broadcast_timeout_s: float = 120.0  # disaggregated: a broadcast waits this long for a stalled peer, then fails
    restart_attempts: int = 2  # per step: restart a crashed engine (with the latest weights) and retry
    # an engine host Ray cannot reach: how long a restart waits for it to answer or be declared dead; also what
    # the engine hosts get, together, to stop their servers at the end of a run
    unreachable_timeout_s: float = 300.0


@dataclass
class TrainConfig:
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # parameters; auto: bf16 on GPUs (fp32 main weights), fp32 on CPUs
    distributed_optimizer: Literal["auto", True, False] = "auto"  # auto: on for GPUs; the CPU cannot run it
    mini_batches: int = 1  # optimizer steps per rollout batch; π_prox from a pass before the first when > 1
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation (Megatron's)
    routing_replay: Literal["none", "r3"] = "none"  # MoE: r3 routes the trainer's forwards by the rollout's experts
    # parameters kept as loaded (no gradient, no optimizer state): experts, the routed experts' weights (MoE only;
    # MoEResQ's discriminator: does the model learn when only attention, routers and norms move?)
    frozen: Literal["none", "experts"] = "none"
    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    pp_size: int = 1  # pipeline stages (Megatron's schedules); the layers must divide evenly
    threads: int = 0  # torch CPU threads per trainer rank; 0 leaves torch's default
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    loss: LossName = "acr"
    eps_low: float = 0.2
    eps_high: float = 0.2
    tis_cap: float = 2.0
    agg: Aggregation = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    advantage: Literal["grpo", "rloo"] = "grpo"
    scale_by_std: bool = True
    dynamic_sampling: bool = False
    # once one trainer rank has answered a call (most are collectives, which end on every rank together), the
    # others have this long; a rank still busy then is hung and ends the run. Also what the ranks get,
    # together, to close at the end of a run
    hang_timeout_s: float = 600.0

    @property
    def world_size(self) -> int:
        """Trainer ranks: TP x DP x PP (experts are sharded within TP x DP)."""
        return self.tp_size * self.dp_size * self.pp_size


@dataclass
class UAQConfig:
    enabled: bool = True
    scale: float = 1.5


@dataclass
class CheckpointConfig:
    dir: str = "runs/demo/checkpoints"
    every: int = 10
    keep: int = 2
    export_hf: bool = True  # at the end of the run, the trained model as an HF checkpoint in dir/hf
    # the trainer's state: torch_dist (Megatron's distributed checkpoint: resumable on another TP/PP/EP/DP) or
    # torch (one file per rank: resumable on the same layout only); either loads, whatever this says
    format: Literal["torch_dist", "torch"] = "torch_dist"
    # torch_dist only: the trainer's files are written in the background (Megatron's asynchronous save) while
    # the next step's rollout runs; the checkpoint is published once they are on disk, before that step trains
    async_save: bool = False
    # after SIGTERM/SIGINT, how long the step in progress may take before the run exits without it (the last
    # checkpoint stays): Slurm kills a job 30 s after its SIGTERM
    stop_grace_s: float = 20.0
    # resume a checkpoint whose model, precision or (format torch) parallel layout differs from the run's
    # (driver.RESUME_FIELDS, LAYOUT_FIELDS)
    allow_mismatch: bool = False


@dataclass
class LoggingConfig:
    dir: str = "runs/demo/logs"
    wandb_project: str = ""  # empty: no Weights & Biases
    update_capture: bool = True  # uaq/update_capture per step (quantized rollout): one extra quantization pass
    progress: bool = True  # a progress bar on stderr


@dataclass
class EvalConfig:
    every: int = 0  # steps between held-out evaluations (also before step 1 and after the last); 0: off
    data: str = ""  # .jsonl or .parquet read like data.path; empty: task addition's split unseen in training
    num_prompts: int = 64  # the file's first rows, or the size of the generated split
    n: int = 1  # samples per prompt
    temperature: float = 0.0  # 0: greedy, accuracy = pass@1; > 0: accuracy = mean@n of n samples
    bf16_reference: bool = False  # also a BF16 engine with the same weights (colocated): eval/accuracy_bf16


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    uaq: UAQConfig = field(default_factory=UAQConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # how both sides compute: a row of qurl_mcore/precision.py (trainer and engines from one name)
    precision: PrecisionName = "int8"
    scope: ScopeName = "auto"  # the linears quantized; auto: the precision's default
    fp4_format: FP4Format = "nvfp4"  # the format of the FP4 precisions
    steps: int = 30
    seed: int = 0
    layout: Literal["colocated", "disaggregated"] = "colocated"
    # the GPU the run is planned for (a key of qurl_mcore.sizing.GPUS, e.g. h200-141g): `qurl plan`'s, `--check`'s
    # and `qurl launch slurm`'s default for --gpu; "" names none
    gpu: str = ""

    def train_dtype(self, cuda: bool | None = None):
        """The trainer's parameter dtype: `train.dtype`, where auto is bf16 with CUDA and fp32 without."""
        # lazy: torch; `qurl --help` imports this module
        import torch

        cuda = torch.cuda.is_available() if cuda is None else cuda
        name = self.train.dtype if self.train.dtype != "auto" else ("bf16" if cuda else "fp32")
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]

    def distributed_optimizer(self, cuda: bool | None = None) -> bool:
        """Whether the trainer shards its optimizer state over data-parallel ranks (auto: on with CUDA)."""
        # lazy: torch; `qurl --help` imports this module
        import torch

        cuda = torch.cuda.is_available() if cuda is None else cuda
        choice = self.train.distributed_optimizer
        return choice is True or (choice == "auto" and cuda)

    def offload_rollout(self, cuda: bool | None = None) -> bool:
        """Whether engines release their GPU memory (weights, KV cache, CUDA graphs) while the trainer steps and
        take it back for the push and the rollout (auto: colocated on GPUs, where the two share each device)."""
        # lazy: torch; `qurl --help` imports this module
        import torch

        cuda = torch.cuda.is_available() if cuda is None else cuda
        choice = self.rollout.offload
        return choice is True or (choice == "auto" and cuda and self.layout == "colocated")

    def push_mode(self, model: Shape) -> str:
        """What weight pushes carry (`rollout.push`) for engines of `model`: "bf16" for full-precision engines;
        "codes" where a code push serves, which is every layout (tensor and broadcast pushes) unless, at TP > 1,
        TP ranks replicate NVFP4 k/v heads (each rank's q/k/v unit has its own global scale, so a replicated k/v
        head holds other codes on each rank, which one wire tensor cannot carry). What the engine needs in full
        precision travels so in a code push: the linears it does not quantize, MLA's kv_b_proj among them (its
        decode weights are rebuilt from it). "auto" is codes where it serves, else bf16; "codes" where it does
        not is refused, naming why."""
        p, scope, fmt = self.resolved_precision()
        if p.rollout is None or self.rollout.push == "bf16":
            return "bf16"
        tp = self.rollout.tp_size
        why = None
        if "attention" in SCOPES[scope] and model.kv_heads % tp and self._global_scale():
            fits = [n for n in range(1, tp) if not model.kv_heads % n and not model.heads % n]
            why = (f"rollout.tp_size {tp} replicates the model's {model.kv_heads} k/v heads, which {fmt} quantizes "
                   f"with each rank's own global scale: use rollout.tp_size={max(fits)} or scope experts")
        if why and self.rollout.push == "codes":
            raise ValueError(f"rollout.push=codes: {why}; or use rollout.push=bf16 or auto")
        return "bf16" if why else "codes"

    def _global_scale(self) -> bool:
        """Whether the engines' weight format has a per-tensor scale (NVFP4's)."""
        # lazy: the format table loads torch; only TP > 1 with replicated k/v heads asks
        from qurl_mcore.quant.wire import has_global_scale

        return has_global_scale(self.recipe().engine.spec)

    def resolved_precision(self):
        """(precision row, scope, format) with the defaults filled in (`qurl_mcore.precision.select`)."""
        p = get_precision(self.precision)
        return select(self.precision, self.scope, self.fp4_format if self.fp4_format in p.formats else None)

    def uaq_scope(self) -> str | None:
        """The scope UAQ rescales (`qurl_mcore.precision.uaq_scope`), None with UAQ off; ValueError where the
        precision and scope take no UAQ (`qurl train --check` names it first)."""
        return uaq_scope(self.precision, self.scope) if self.uaq.enabled else None

    def recipe(self, te_available: bool | None = None):
        """The `qurl_mcore.recipe.Recipe` of precision, scope and FP4 format (it imports torch, which the schema
        and `qurl plan` do without); `te_available` None: whether this process can run Transformer Engine."""
        # lazy: recipe.py loads torch; `qurl --help` imports this module
        from qurl_mcore.recipe import resolve

        p, scope, fmt = self.resolved_precision()
        return resolve(p.name, scope, fmt, te_available=te_available)


class ConfigError(ValueError):
    """Raised with every problem found, one per line (`problems`: the lines themselves)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def _within(lo: float, hi: float, *, open_lo: bool = False, open_hi: bool = False):
    """(test, meaning) of the interval from lo to hi; an infinite or NaN value is outside every one."""
    def test(v) -> bool:
        return (lo < v if open_lo else lo <= v) and (v < hi if open_hi else v <= hi)

    return test, f"must be in {'(' if open_lo else '['}{lo:g}, {hi:g}{')' if open_hi else ']'}"


_POSITIVE = (lambda v: v > 0, "must be positive")
_NON_NEGATIVE = (lambda v: v >= 0, "must be >= 0")
#: field -> (the test its value must pass, what that means). Every float field has a bounded interval, so
#: .inf and absurd values (lr=1e9) are refused where they are given, not steps later as NaN weights.
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{name: _POSITIVE for name in (
        "data.prompts_per_step", "data.num_prompts", "data.max_operand", "rollout.samples_per_prompt",
        "rollout.max_new_tokens", "rollout.engines", "rollout.tp_size", "rollout.context_length",
        "rollout.push_bucket_mb", "train.tp_size", "train.ep_size", "train.dp_size", "train.pp_size",
        "train.mini_batches", "checkpoint.every", "checkpoint.keep", "steps", "eval.num_prompts", "eval.n")},
    **{name: _NON_NEGATIVE for name in (
        "data.min_operand", "rollout.max_total_tokens", "rollout.restart_attempts", "train.threads", "eval.every")},
    "train.micro_batch_size": _within(1, 65536),
    "rollout.temperature": _within(0, 10),
    "eval.temperature": _within(0, 10),
    "rollout.top_p": _within(0, 1, open_lo=True),
    "rollout.smoothing": _within(0, 1),
    "rollout.top_k": (lambda v: v == -1 or v > 0, "must be -1 (off) or a positive count"),
    "rollout.mem_fraction": (_within(0, 1, open_hi=True)[0], "must be in [0, 1) (0: SGLang's default)"),
    **{name: (_within(0, 86400, open_lo=True)[0], "must be in (0, 86400] seconds") for name in (
        "rollout.broadcast_timeout_s", "rollout.unreachable_timeout_s", "train.hang_timeout_s",
        "checkpoint.stop_grace_s")},
    "train.lr": _within(0, 1, open_lo=True),
    "train.weight_decay": _within(0, 1),
    "train.grad_clip": _within(0, 1e4),
    "train.eps_low": _within(0, 1, open_hi=True),
    "train.eps_high": _within(0, 10),
    "train.tis_cap": _within(1, 1e4),
    "train.kl_coef": _within(0, 100),
    "train.entropy_coef": _within(0, 1),
    "uaq.scale": _within(0, 16, open_lo=True),
    # the form only: `qurl train --check` imports a user's function and checks its signature
    "data.reward": (lambda v: v in REWARDS or DOTTED.fullmatch(v) is not None,
                    f"must be one of {list(REWARDS)} or package.module:function"),
}


def _check_value(name: str, value, hint, errors: list[str]):
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            errors.append(f"{name}: {value!r} is not one of {list(choices)}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            errors.append(f"{name}: expected true or false, got {value!r}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads 3e-6 (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if not isinstance(value, hint) or isinstance(value, bool) and hint is not bool:
        errors.append(f"{name}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
        return value
    test, meaning = RANGES.get(name, (None, ""))
    if test is not None and not (value == value and test(value)):  # value == value: NaN fails every range
        errors.append(f"{name}: {meaning}, got {value!r}")
    return value


#: fields that moved, with where they went
MOVED = {
    "rollout.precision": "precision (one name for the trainer and the engines: qurl_mcore/precision.py)",
    "train.recipe": "precision (one name for the trainer and the engines: qurl_mcore/precision.py)",
    "rollout.scope": "scope",
    "rollout.fp4_format": "fp4_format",
}


def _build(cls, data: dict, prefix: str, errors: list[str]):
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if f"{prefix}{key}" in MOVED:
            errors.append(f"{prefix}{key}: moved to the top-level field {MOVED[prefix + key]}")
        elif key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            errors.append(f"{prefix}{key}: unknown field" + (f" (did you mean {prefix}{close[0]}?)" if close else
                                                             f"; known: {sorted(known)}"))
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        hint, value, name = hints[f.name], data[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                errors.append(f"{name}: expected a mapping of {hint.__name__} fields, got {value!r}")
                continue
            kwargs[f.name] = _build(hint, value, f"{name}.", errors)
        else:
            kwargs[f.name] = _check_value(name, value, hint, errors)
    return cls(**kwargs)


def _parse_yaml(text: str) -> tuple[Any, str | None]:
    """(the value, None), or (None, why `text` is not YAML, with the line and column where it stops)."""
    # lazy: PyYAML only where a YAML file is read; `qurl --help` imports this module
    import yaml

    try:
        return yaml.safe_load(text), None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = ": ".join(filter(None, (getattr(err, "context", None), getattr(err, "problem", None)))) or str(err)
        return None, f"line {mark.line + 1} column {mark.column + 1}: {problem}" if mark else problem


def read_yaml(path: str | Path) -> Any:
    """The YAML file `path`; ConfigError naming the file, line and column if it is not YAML."""
    value, problem = _parse_yaml(Path(path).read_text())
    if problem:
        raise ConfigError(f"{path}: not valid YAML: {problem}")
    return value


def _apply_override(data: dict, item: str, errors: list[str]) -> None:
    if "=" not in item:
        errors.append(f"override {item!r}: expected key=value, e.g. train.lr=1e-6")
        return
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            errors.append(f"override {item!r}: {part} is not a section")
            return
    value, problem = _parse_yaml(raw) if raw.strip() else ("", None)
    if problem:
        errors.append(f"override {item!r}: the value is not YAML ({problem}; quote a string: key='...')")
        return
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file (if any), then the overrides; raises ConfigError listing every bad field.
    Rules that involve several fields, the model or the cluster are `qurl_mcore.preflight`'s."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = read_yaml(path) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    errors: list[str] = []
    for item in overrides:
        _apply_override(data, item, errors)
    cfg = _build(Config, data, "", errors)
    if errors:
        where = f" in {path}" if path else ""
        raise ConfigError(f"{len(errors)} problem(s){where}:\n  " + "\n  ".join(errors), errors)
    return cfg


def to_dict(cfg: Config) -> dict:
    """The full resolved config, for logs and checkpoints."""
    return dataclasses.asdict(cfg)


def flatten(data: typing.Mapping, prefix: str = "") -> dict:
    """A nested config mapping (`to_dict`'s, a checkpoint's, a YAML file's) as {dotted key: value}: the keys
    `load_config`'s overrides take."""
    out = {}
    for key, value in data.items():
        if isinstance(value, typing.Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
