"""`qurl train --check`: every rule that involves more than one field, checked before anything starts.

`preflight(cfg)` reads the model's config.json, its weights' headers and its tokenizer (every prompt row is
measured by it), scores the reward on the first rows' answers, checks that no other run holds the run's
directories, applies the precision table and the placement rules, and returns the problems (each naming the fields and the fix) together with a summary of
the resolved run: the precision of each side and the linears each quantizes, the layout and where the
actors go. Nothing here starts Ray, Megatron or SGLang, or imports them; `qurl train` runs the same
checks first and refuses to start on any problem.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import Config
from .heldout import eval_examples, greedy_repeats
from .models import ARCHITECTURES, resolve_model_path
from .placement import placement_of, unplaceable
from .models.registry import hf_linears, num_experts, shape, slots
from .precision import METHODS, SCOPES, quantized_linears
from .sglang.kernels import KERNEL_FORMATS
from .runlock import in_use
from .sizing import GPUS, batch_bytes, check_fits, local_gpu, model_config, parameter_count, trainer_bytes
from .sizing.gpus import GiB
from .smoothing import fold_table, refusal
from .stack import Stack, experts, fusions, grad_norm
from .tasks import (REWARDS, Example, addition_examples, chat_ids, load_reward, prompt_file_problem,
                    replies_stating, scan_examples, score_all)


BAD_ROWS_NAMED = 5  # the check counts every bad prompt row and names the first few
# the CPU demo's step (README: 18 s, 8 prompts x 6 samples of up to 6 new tokens, SmolLM2-135M's 134.5M
# parameters, 2 cores): what `--check` scales a CPU run's step time from
CPU_DEMO_STEP_S = 18.0
CPU_DEMO_WORK = 134_515_008 * 8 * 6 * 6
REWARD_PROBE_ROWS = 8  # the reward is scored on replies stating the answers of the first rows


@dataclass
class Preflight:
    """The outcome: `problems` (empty: the run may start) and `summary` lines describing the run."""

    problems: list[str] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def report(self) -> str:
        if self.problems:
            return f"{len(self.problems)} problem(s):\n  " + "\n  ".join(self.problems)
        return "\n".join(self.summary)


def _linears_line(hf: dict, names: set[str]) -> str:
    if not names:
        return "none (full precision)"
    groups = hf_linears(hf)
    counts = collections.Counter(groups[n] for n in names)
    return f"{len(names)} linears (" + ", ".join(f"{g} {c}" for g, c in sorted(counts.items())) + ")"


def _field_rules(cfg: Config, out: Preflight, use_gpu: bool) -> None:
    """Rules between fields of the config alone."""
    t, r, d = cfg.train, cfg.rollout, cfg.data
    if d.task == "file" and not d.path:
        out.problems.append("data.path: task 'file' needs the path of a .jsonl or .parquet prompt file")
    elif d.task == "file" and prompt_file_problem(d.path):
        out.problems.append(f"data.path: {prompt_file_problem(d.path)}")
    for name, path in (("checkpoint.dir", cfg.checkpoint.dir), ("logging.dir", cfg.logging.dir)):
        problem = unwritable(Path(path))
        if problem:
            out.problems.append(f"{name}: {problem}; the run would stop at its first write, losing its steps")
    if t.advantage in ("grpo", "rloo") and r.samples_per_prompt < 2:
        out.problems.append(f"rollout.samples_per_prompt: {t.advantage} compares samples of one prompt; "
                            "use at least 2")
    if (t.tp_size * t.dp_size) % t.ep_size:
        out.problems.append(f"train.ep_size: {t.ep_size} must divide tp_size x dp_size = {t.tp_size * t.dp_size} "
                            "(experts are sharded within a pipeline stage)")
    if t.entropy_coef and t.tp_size > 1:
        out.problems.append("train.entropy_coef: the entropy bonus needs the full vocabulary on a rank; "
                            "use train.tp_size=1")
    if cfg.gpu and cfg.gpu not in GPUS:
        out.problems.append(f"gpu: unknown GPU {cfg.gpu!r}; use one of {list(GPUS)}, or leave it empty")
    try:
        cfg.uaq_scope()
    except ValueError as err:
        out.problems.append(f"uaq.enabled: {err}")
    if not use_gpu and cfg.train.distributed_optimizer is True:
        out.problems.append("train.distributed_optimizer: Megatron's distributed optimizer needs CUDA tensors "
                            "(it checks for torch.cuda types); on CPUs use false or auto")
    if not use_gpu and cfg.train.dtype == "bf16":
        out.problems.append("train.dtype: bf16 training uses Megatron's mixed-precision optimizer, which needs CUDA "
                            "tensors; on CPUs use fp32 or auto")
    precision, _, fmt = cfg.resolved_precision()
    if use_gpu and r.dtype == "float32" and fmt in KERNEL_FORMATS:
        out.problems.append(f"rollout.dtype: float32 engines cannot run SGLang's W8A8 {fmt} kernels (they write "
                            "bf16/fp16 outputs); use rollout.dtype=bfloat16")
    if r.requant == "compiled" and precision.rollout is not None:
        problem = _compile_toolchain(use_gpu)
        if problem:
            out.problems.append(f"rollout.requant: compiled re-quantization runs torch.compile, which {problem}; "
                                "install it or use rollout.requant=eager")
    if cfg.checkpoint.async_save and cfg.checkpoint.format != "torch_dist":
        out.problems.append(f"checkpoint.async_save: Megatron's asynchronous save writes the torch_dist format, not "
                            f"{cfg.checkpoint.format!r}; use checkpoint.format=torch_dist or async_save=false")
    if r.offload is True and cfg.layout != "colocated":
        out.problems.append("rollout.offload: engines give their GPU memory to the trainer rank on the same GPU, "
                            "which only the colocated layout has; use false or auto")
    if r.max_new_tokens >= r.context_length:
        out.problems.append(f"rollout.max_new_tokens: {r.max_new_tokens} leaves no room for the prompt in "
                            f"rollout.context_length {r.context_length}; lower it or raise the context")
    try:  # a user's package.module:function: importable here, with a reward's signature
        load_reward(d.reward)
    except ValueError as err:
        out.problems.append(f"data.reward: {err}")


def _lock_rules(cfg: Config, out: Preflight) -> None:
    """The run's directories are free: a run that holds one (qurl_mcore/runlock.py) is named."""
    for name, path in (("checkpoint.dir", cfg.checkpoint.dir), ("logging.dir", cfg.logging.dir)):
        problem = in_use(path)
        if problem:
            out.problems.append(f"{name}: {problem}")


def _cpu_step(cfg: Config, hf: dict[str, Any], out: Preflight) -> None:
    """On CPUs, a step's time scaled from the CPU demo's by parameters x sampled tokens (the work of rollout and
    training both grows with it); a step of hours is warned of."""
    r = cfg.rollout
    samples = cfg.data.prompts_per_step * r.samples_per_prompt
    work = parameter_count(shape(hf)) * samples * r.max_new_tokens
    seconds = CPU_DEMO_STEP_S * work / CPU_DEMO_WORK
    when = next(f"{seconds / unit:.3g} {name}" for unit, name in ((86400, "days"), (3600, "h"), (60, "min"), (1, "s"))
                if seconds >= unit or unit == 1)
    out.summary.append(f"  cpu step    ~{when} a step: {samples} samples of up to {r.max_new_tokens} new tokens, "
                       f"scaled from the CPU demo's {CPU_DEMO_STEP_S:g} s step on 2 cores by parameters x samples x "
                       "new tokens")
    if seconds > 3600:
        out.summary.append(f"  warning     a step of {samples} samples takes hours on CPUs: lower "
                           "data.prompts_per_step or rollout.samples_per_prompt, or run on GPUs")


def _cpu_memory(cfg: Config, hf: dict[str, Any], out: Preflight, local: bool, longest: int | None) -> None:
    """On CPUs, a trainer rank's bytes as `qurl plan` counts them at fp32 (`sizing.trainer_bytes`: states, one
    micro-batch's activations) plus the step's batch it holds (`sizing.batch_bytes`), for sequences of the
    longest prompt (`longest` tokens, None: unknown) and rollout.max_new_tokens, padded as a step pads them, at
    most rollout.context_length. For a run on this machine, every rank's together are compared with its memory,
    and more is warned of. The engines' are not counted."""
    r = cfg.rollout
    seq = r.context_length if longest is None else min(r.context_length, longest + r.max_new_tokens)
    padded = dataclasses.replace(cfg, rollout=dataclasses.replace(r, context_length=seq))
    s = shape(hf)
    plan = trainer_bytes(s, padded, cuda=False)
    batch = batch_bytes(s, padded)
    rank = plan["peak"] + batch
    world = cfg.train.world_size
    out.summary.append(f"  cpu memory  ~{rank / GiB:.2f} GiB a trainer rank at {seq} tokens a sequence: states "
                       f"{plan['static'] / GiB:.2f} GiB, a micro-batch's activations "
                       f"{(plan['peak'] - plan['static']) / GiB:.2f} GiB, the step's batch {batch / GiB:.2f} GiB "
                       "(engines not counted)")
    here = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if local and world * rank > here:
        out.summary.append(f"  warning     {world} trainer rank(s) need ~{world * rank / GiB:.0f} GiB, more than this "
                           f"machine's {here / GiB:.0f} GiB: lower train.micro_batch_size or rollout.context_length "
                           "(activations), data.prompts_per_step or rollout.samples_per_prompt (the batch)")


def _longest_addition_prompt(cfg: Config, model_path: str | None) -> int | None:
    """The longest prompt of the addition task in tokens by the model's chat template (None without the model)."""
    if model_path is None:
        return None
    from transformers import AutoTokenizer

    d = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    examples = addition_examples(d.num_prompts, seed=cfg.seed, min_operand=d.min_operand, max_operand=d.max_operand)
    return max(len(chat_ids(tokenizer, ex, d.system_prompt)) for ex in examples)


def _logging_rules(cfg: Config, out: Preflight) -> None:
    """logging.wandb_project needs wandb where the driver runs: an optional package (requirements/wandb.txt),
    imported only at the run's first log."""
    project = cfg.logging.wandb_project
    if project and importlib.util.find_spec("wandb") is None:
        out.problems.append(f"logging.wandb_project: {project!r} logs to Weights & Biases, but wandb is not "
                            "installed here; pip install -r requirements/wandb.txt (or the package's [wandb] "
                            "extra), or leave logging.wandb_project empty")


def _compile_toolchain(use_gpu: bool) -> str | None:
    """What torch.compile's inductor lacks here, or None: Triton on GPUs, a C++ compiler ($CXX, else g++) on CPUs."""
    if use_gpu:
        return None if importlib.util.find_spec("triton") else "needs Triton on GPUs (not installed)"
    compiler = os.environ.get("CXX", "g++")
    return None if shutil.which(compiler) else f"needs a C++ compiler on CPUs ({compiler} is not on PATH)"


def _eval_rules(cfg: Config, out: Preflight) -> None:
    """The held-out evaluation's rules (`eval.*`), and its summary line."""
    e, d = cfg.eval, cfg.data
    if not e.every:  # off, the other eval.* fields included: eval.every=0 alone turns a config's evaluation off
        return

    if greedy_repeats(cfg):
        out.problems.append(greedy_repeats(cfg))
    if e.bf16_reference and cfg.layout != "colocated":
        out.problems.append("eval.bf16_reference: the BF16 engine shares engine 0's bundle and takes tensor pushes "
                            "from trainer rank 0 beside it, which only layout=colocated has; use "
                            "eval.bf16_reference=false (eval/accuracy alone), or layout=colocated")
    try:  # the rows the run reads, or the split it generates
        train = [] if e.data or d.task != "addition" else addition_examples(
            d.num_prompts, seed=cfg.seed, min_operand=d.min_operand, max_operand=d.max_operand)
        held_out = eval_examples(cfg, train)
    except ValueError as err:
        out.problems.append(str(err))
        return
    where = e.data or "additions that are no training prompt"
    how = "greedy, pass@1" if e.temperature == 0 else f"{e.n} samples at temperature {e.temperature}, mean@{e.n}"
    out.summary.append(f"  eval        every {e.every} steps and at step 0: {len(held_out)} prompts ({where}), {how}, "
                       + ("rollout engines and a BF16 engine" if e.bf16_reference else "rollout engines"))


def _prompt_rows(cfg: Config, out: Preflight, model_path: str | None) -> int | None:
    """Every row of data.path, streamed as the run reads it (valid JSON, a non-empty prompt and answer) and,
    with the model here, each prompt's length in tokens by the model's chat template, which must leave
    rollout.max_new_tokens of rollout.context_length for the answer. The first few bad rows are named, all
    are counted. Returns the longest prompt's tokens (None where not measured)."""
    d, r = cfg.data, cfg.rollout
    if d.task != "file" or not d.path or prompt_file_problem(d.path):
        return None  # the field rules named the path
    budget = r.context_length - r.max_new_tokens  # the field rules refuse a budget of 0 or less
    tokenizer = None
    if model_path is not None and budget > 0:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    bad, rows, longest, first = [], 0, 0, []
    try:
        for where, example in scan_examples(d.path, prompt_key=d.prompt_key, answer_key=d.answer_key):
            rows += 1
            if isinstance(example, str):
                bad.append(example)
                continue
            if len(first) < REWARD_PROBE_ROWS:
                first.append(example)
            if tokenizer is not None:
                length = len(chat_ids(tokenizer, example, d.system_prompt))
                longest = max(longest, length)
                if length > budget:
                    bad.append(f"{where}: the prompt is {length} tokens, over the {budget} that rollout.context_length "
                               f"{r.context_length} leaves after rollout.max_new_tokens {r.max_new_tokens}")
    except (ValueError, OSError) as err:
        out.problems.append(f"data.path: {err}")
        return None
    out.problems += [f"data.path: {problem}" for problem in bad[:BAD_ROWS_NAMED]]
    if len(bad) > 1:
        out.problems.append(f"data.path: {len(bad)} bad rows of {rows} (the first {min(len(bad), BAD_ROWS_NAMED)} "
                            "above); fix or drop them (a long prompt: or raise rollout.context_length)")
    elif not rows:
        out.problems.append(f"data.path: {d.path} holds no prompts")
    if tokenizer is not None and rows:
        out.summary.append(f"  data        {rows} prompts, the longest {longest} tokens (room: {budget})")
    if first:
        _reward_probe(cfg, first, out)
    return longest if tokenizer is not None and rows else None


def _reward_probe(cfg: Config, examples: list[Example], out: Preflight) -> None:
    """data.reward scored on replies that state the answers of the data's first rows (`replies_stating`): a
    reward that pays none of them would pay nothing all run, every advantage zero (the answer key names the
    wrong field, or the answers are of a kind the reward does not read). A built-in reward is refused; a
    user's, whose reply format the check cannot know, gets a note."""
    d = cfg.data
    try:
        fn = load_reward(d.reward)
    except ValueError:
        return  # the field rules named it
    pairs = [(reply, ex.answer) for ex in examples for reply in replies_stating(d.reward, ex.answer)]
    scores, stats = score_all(fn, [reply for reply, _ in pairs], [answer for _, answer in pairs])
    if any(score > 0 for score in scores):
        return
    raised = f", raising {stats.messages[0]}" if stats.errors else ""
    why = (f"data.reward: {d.reward} pays nothing for a reply that states the answer, on each of the first "
           f"{len(examples)} rows (the first answer: {examples[0].answer!r}{raised}), so it would pay nothing all "
           f"run: data.answer_key {d.answer_key!r} may name the wrong field (verl's layout: "
           "reward_model.ground_truth), or the answers are of a kind the reward does not read (data.reward=math "
           "reads LaTeX and expressions)")
    if d.reward in REWARDS:
        out.problems.append(why)
    else:
        out.summary.append(f"  note        {why}; unless your reward reads another form of reply, fix it")


def unwritable(path: Path) -> str | None:
    """Why nothing could be written at `path`, or None: proven by creating it if missing and writing a file in
    it (permissions alone do not say: root passes every access check, /proc refuses root), then removing what
    was made."""
    path = path.absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    made = [p for p in [path, *path.parents] if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".qurl-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return f"nothing can be written in {path} ({err.strerror})"
    finally:
        for p in made:  # innermost first: a check leaves nothing behind
            with contextlib.suppress(OSError):
                p.rmdir()
    return None


def _model_config(cfg: Config, out: Preflight) -> tuple[str, dict[str, Any]] | None:
    try:
        path = resolve_model_path(cfg.model.path)
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        out.problems.append(f"model.path: {err}")
        return None
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        out.problems.append(f"model.path: {path} has a config.json but no *.safetensors weights; give an HF "
                            "checkpoint directory")
        return None
    damaged = [f"model.path: {file} {why}; download or copy it again" for file in weights
               for why in [_safetensors_damage(file)] if why]
    if damaged:
        out.problems += damaged
        return None
    if hf.get("model_type") not in ARCHITECTURES:
        out.problems.append(f"model.path: {path} is a {hf.get('model_type')!r} model; qurl-mcore trains "
                            f"{list(ARCHITECTURES)}")
        return None
    return str(path), hf


def _safetensors_damage(file: Path) -> str | None:
    """What is wrong with a safetensors file, read from its header alone, or None. The format: 8 bytes
    (little-endian) giving the header's length n, n bytes of JSON naming each tensor's [begin, end) in the data
    that follows, and the data, as long as the largest end: a truncated copy is shorter."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is {size} bytes, too short for a safetensors header"
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            return f"is truncated: its header says {n} bytes of JSON, the file has {size - 8} after the length"
        try:
            header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            return f"has a damaged header ({err})"
    if 8 + n + end != size:
        return f"is {size} bytes where its header says {8 + n + end}" + (" (truncated)" if size < 8 + n + end else "")
    return None


def _model_card(cfg: Config, out: Preflight) -> tuple[str, dict[str, Any]] | None:
    """When the check plans for a named GPU (a cluster) and model.path is not on this machine: the shape from
    the architecture card of its basename, the missing path becoming a note instead of a problem."""
    try:
        hf, source = model_config(cfg.model.path)
    except ValueError:
        return None
    out.problems = [p for p in out.problems if not p.startswith("model.path:")]
    out.summary.append(f"  note        {cfg.model.path} is not on this machine: planned from the {source}")
    return cfg.model.path, hf


def _smoothing_rules(cfg: Config, hf: dict | None, out: Preflight) -> None:
    """rollout.smoothing > 0 needs an engine format it serves and, in the model, a smoothed point among the
    linears the scope quantizes (qurl_mcore/smoothing.py); its summary line."""
    alpha = cfg.rollout.smoothing
    if not alpha:
        return
    _, scope, fmt = cfg.resolved_precision()
    why = refusal(fmt)
    if why:
        out.problems.append(f"rollout.smoothing: {alpha} with precision {cfg.precision!r}: {why}; set "
                            "rollout.smoothing=0, or use precision int8 or fp8")
    elif hf is not None and not fold_table(hf, SCOPES[scope]):
        out.problems.append(f"rollout.smoothing: {alpha}, but scope {scope!r} quantizes none of the linears "
                            f"smoothing serves in a {hf['model_type']} model (attention, a dense MLP, a shared "
                            "expert's down projection); set rollout.smoothing=0, or use scope=all")
    else:
        out.summary.append(f"  smoothing   α = {alpha}: scales calibrated on the run's prompts, folded into every "
                           "weight push")


def _parallel_checks(cfg: Config, hf: dict, out: Preflight) -> None:
    t, r = cfg.train, cfg.rollout
    heads, groups = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    for name, tp in (("train.tp_size", t.tp_size), ("rollout.tp_size", r.tp_size)):
        if heads % tp or groups % tp:
            out.problems.append(f"{name}: {tp} must divide the model's {heads} attention heads and {groups} "
                                f"key-value heads")
    _block_shards(cfg, hf, out)
    if hf["num_hidden_layers"] % t.pp_size:
        out.problems.append(f"train.pp_size: {t.pp_size} must divide the model's {hf['num_hidden_layers']} layers")
    experts = num_experts(hf)
    if t.ep_size > 1 and not experts:
        out.problems.append(f"train.ep_size: {t.ep_size} needs an MoE model; this one is dense, use 1")
    elif experts and experts % t.ep_size:
        out.problems.append(f"train.ep_size: {t.ep_size} must divide the model's {experts} experts")
    if t.frozen != "none" and not experts:
        out.problems.append(f"train.frozen: {t.frozen} freezes the routed experts; this model is dense, use none")
    if t.routing_replay != "none" and not experts:
        out.problems.append(f"train.routing_replay: {t.routing_replay} replays MoE routing; this model is dense, "
                            "use none")
    if t.routing_replay != "none" and t.recompute == "full" and t.pp_size > 1:
        # the pipeline schedule recomputes a micro-batch after later ones set their replay targets
        out.problems.append("train.routing_replay: r3 with train.recompute full and train.pp_size > 1 is not "
                            "supported; use recompute selective (or none), or pp_size 1")


def _block_shards(cfg: Config, hf: dict, out: Preflight) -> None:
    """An engine of TP > 1 quantizes each TP shard of a row-parallel linear (o_proj, down_proj, an expert's down)
    on its own, so a block-scaled weight format needs every shard's input columns to be whole blocks: a block
    that straddles two shards is two partial blocks in the engine and one whole block in the trainer."""
    tp, engine = cfg.rollout.tp_size, cfg.recipe().engine
    block = engine.format.block if engine is not None else None
    if tp == 1 or not block:
        return
    widths: dict[int, str] = {}
    for slot in slots(hf):
        if slot.layout == "columns" and slot.quantizable and slot.group in engine.groups:
            for name, dims in zip(slot.hf, slot.shapes(shape(hf))):
                widths.setdefault(dims[-1], name.split(".")[-2])
    heads, groups = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    for width, name in sorted(widths.items()):
        if width % (tp * block):
            fits = max(n for n in range(1, tp) if n == 1 or (not heads % n and not groups % n
                                                              and all(not w % (n * block) for w in widths)))
            out.problems.append(f"rollout.tp_size: {tp} splits {name}'s {width} input columns into shards of "
                                f"{width / tp:g}, not whole {engine.fmt} blocks of {block}: each engine shard "
                                f"would quantize other blocks than the trainer; use rollout.tp_size={fits}")
            return


def _memory_plan(cfg: Config, hf: dict[str, Any], out: Preflight, gpu: str | None) -> None:
    """On GPUs: the run's bytes per GPU (`qurl plan`, qurl_mcore/sizing) on `gpu` (default: this machine's kind of
    GPU); a plan that does not fit is refused, each problem naming its lever."""
    gpu = gpu or local_gpu()
    if gpu is None:
        out.summary.append("  memory      not planned: no GPU of the planner's table here (qurl plan --gpu ...)")
        if cfg.layout == "colocated" and not cfg.rollout.mem_fraction:
            out.problems.append("rollout.mem_fraction: 0 lets each engine take SGLang's default share of a GPU it "
                                "shares with a trainer rank; set it (qurl plan --config FILE --gpu GPU prints the "
                                "fraction that fits)")
        return
    problems = check_fits(cfg, hf, gpu)
    out.problems += [f"memory ({gpu}): {p}" for p in problems]
    if not problems:
        out.summary.append(f"  memory      fits on {gpu} (qurl plan --config ... --gpu {gpu} for the bytes)")


def _placement(cfg: Config, use_gpu: bool, out: Preflight, local: bool) -> None:

    try:
        placement = placement_of(cfg, use_gpu)
    except ValueError as err:
        out.problems.append(str(err))
        return
    if local:  # `qurl train` starts a one-node Ray cluster of this machine's devices
        present = {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}
        problem = unplaceable(placement, present, "this machine")
        if problem:
            out.problems.append(problem)
    t = cfg.train
    world = t.world_size
    devices = sum(b.get(placement.device, 0) for b in placement.bundles)
    out.summary.append(f"  layout      {cfg.layout}: trainer TP {t.tp_size} x DP {t.dp_size} x PP {t.pp_size} "
                       f"(EP {t.ep_size}) = "
                       f"{world} rank(s); {cfg.rollout.engines} engine(s) of TP {cfg.rollout.tp_size}; "
                       f"{len(placement.bundles)} bundle(s), {devices:g} {placement.device}(s) in all")


def _kernel_lines(cfg: Config, moe: bool, out: Preflight) -> None:
    """The trainer's Megatron fusions and gradient-norm kernel on this process's stack (a trainer node's may
    differ: the rank decides with the same tables, `stack.fusions`, `stack.grad_norm`) and, for an MoE model,
    its experts module."""
    choice = fusions(Stack.installed())
    on = [name for name, (yes, _) in choice.items() if yes]
    out.summary.append(f"  fusions     {', '.join(on) or 'none'} on (this node's stack)")
    for name, (yes, why) in choice.items():
        if not yes:
            out.summary.append(f"              {name} off: {why}")
    kernel, what = grad_norm(Stack.installed())
    out.summary.append(f"  grad norm   {kernel}: {what}")
    if moe:
        name, why = experts(cfg.recipe())
        out.summary.append(f"  experts     {name}: {why}")


def preflight(cfg: Config, use_gpu: bool | None = None, local: bool = False, gpu: str | None = None) -> Preflight:
    """Check `cfg` as a whole (the fields themselves were checked by `load_config`). `use_gpu`: whether the
    run targets GPUs (default: whether this machine has one, or a `gpu` is named); `local`: the run starts its
    own Ray cluster on this machine, so the placement must fit this machine's CPUs and GPUs; `gpu`: the kind
    of GPU to plan the memory for (a key of `sizing.GPUS`; default: this machine's)."""
    out = Preflight()
    if use_gpu is None and gpu is not None:
        use_gpu = True
    if use_gpu is None:
        use_gpu = torch.cuda.is_available()
    precision, scope, fmt = cfg.resolved_precision()
    _field_rules(cfg, out, use_gpu)
    _lock_rules(cfg, out)
    _logging_rules(cfg, out)
    model = _model_config(cfg, out)
    if model is None and gpu is not None:  # planning for a cluster from here: its checkpoints may not be here
        model = _model_card(cfg, out)
    r = cfg.rollout
    laid_out = False
    out.summary.append(f"  precision   {precision.name} ({precision.kind}): {precision.summary}")
    default = " (the precision's default)" if cfg.scope == "auto" else ""
    out.summary.append(f"              scope {scope}{default}, format {fmt or 'none'}")
    if model is not None:
        path, hf = model
        kind = f"MoE, {num_experts(hf)} experts" if num_experts(hf) else "dense"
        out.summary.insert(0, f"  model       {path} ({hf['model_type']}, {hf['num_hidden_layers']} layers, {kind})")
        before = len(out.problems)
        _parallel_checks(cfg, hf, out)
        laid_out = len(out.problems) == before  # else there is no layout to plan the memory of
        if laid_out and use_gpu:
            _memory_plan(cfg, hf, out, gpu)
        elif laid_out:
            _cpu_step(cfg, hf, out)
        train = quantized_linears(hf, precision.name, scope, side="train")
        roll = quantized_linears(hf, precision.name, scope, side="rollout")
        mode = f"mode {precision.train}" if precision.trains_quantized else "full precision"
        out.summary.append(f"  trainer     Megatron, {mode}: quantizes {_linears_line(hf, train)}")
        method = f"{precision.rollout} (mode {METHODS[precision.rollout].mode})" if precision.rollout else "bf16"
        out.summary.append(f"  engines     SGLang {method}, dtype {r.dtype}: quantize {_linears_line(hf, roll)}")
    _smoothing_rules(cfg, None if model is None else model[1], out)
    model_dir = model[0] if model is not None and Path(model[0]).is_dir() else None
    longest = _prompt_rows(cfg, out, model_dir)
    if model is not None and laid_out and not use_gpu:
        if cfg.data.task == "addition":
            longest = _longest_addition_prompt(cfg, model_dir)
        _cpu_memory(cfg, model[1], out, local, longest)
    _placement(cfg, use_gpu, out, local)
    t = cfg.train
    dtype = str(cfg.train_dtype(use_gpu)).removeprefix("torch.")
    out.summary.append(f"  training    {dtype} parameters" + (" with fp32 main weights" if dtype == "bfloat16" else "")
                       + f", {'distributed' if cfg.distributed_optimizer(use_gpu) else 'replicated'} Adam, "
                       f"{t.mini_batches} optimizer step(s) per batch, recompute {t.recompute}")
    out.summary.append(f"  loss        {t.loss} (eps {t.eps_low}/{t.eps_high}), {t.advantage} advantages, lr {t.lr}, "
                       f"{cfg.data.prompts_per_step} prompts x {r.samples_per_prompt} samples per step, "
                       f"{cfg.steps} steps")
    _kernel_lines(cfg, model is not None and num_experts(model[1]) > 0, out)
    out.summary.append("  uaq         " + (f"on, s = {cfg.uaq.scale}, scope {precision.uaq}" if cfg.uaq.enabled
                                             else "off"))
    _eval_rules(cfg, out)
    out.summary.append(f"  outputs     checkpoints {cfg.checkpoint.dir} (every {cfg.checkpoint.every}), "
                       f"logs {cfg.logging.dir}")
    return out
