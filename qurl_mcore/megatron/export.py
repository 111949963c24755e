"""A trained model out of the project: an HF checkpoint directory (safetensors, config, tokenizer) that
transformers and SGLang load as they load the model it was trained from.

`write_hf_checkpoint` is collective over the model's ranks (it gathers shards with `export_hf_weights`) and
streams: rank 0 writes each bucket to a file of its own as soon as it is gathered, then the index. The UAQ
rescaling the trainer trains in is undone on the way out (s⁻¹ per tensor, `qurl_mcore.uaq`), so the exported
weights compute the function of the model as trained, in its usual parameterisation.

`unscale_hf_checkpoint` undoes UAQ in an HF checkpoint written by someone else's loop from a UAQ-scaled model
(slime's `--save-hf` of a run with `uaq_hook`, docs/integrations.md), which records no UAQ factor itself.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from qurl_mcore.models.registry import ARCHITECTURES, hf_uaq_role
from qurl_mcore.uaq import rescales, uaq_scale_hf

from .convert import export_hf_weights

#: files of the source checkpoint that describe the model rather than hold its weights
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


#: written into every directory an export makes: the mark that lets a later export replace it
_MARK = ".qurl-export"
#: names an export (`write_hf_checkpoint`) writes, so that one written before the mark existed is still its own
_EXPORT_NAME = re.compile(r"model-\d{5}\.safetensors|model\.safetensors\.index\.json|" + "|".join(
    re.escape(n) for n in _MODEL_FILES))
#: what marks a directory as (part of) a run's checkpoints (or a Megatron-LM one), which no export deletes
_CHECKPOINT_NAME = re.compile(r"meta\.json|rank\d+\.pt|driver\.pt|step_\d{8}(\.partial)?|__\d+_\d+\.distcp|"
                              r"latest_checkpointed_iteration\.txt")


def _holds_checkpoint(path: Path) -> bool:
    """Whether directory `path`, at any depth, holds a checkpoint's files."""
    return any(_CHECKPOINT_NAME.fullmatch(p.name) for p in path.rglob("*"))


def _inside_checkpoint(path: Path) -> bool:
    parents = path.resolve().parents
    return (parents[0] / "meta.json").is_file() or any(_CHECKPOINT_NAME.fullmatch(p.name) for p in parents)


def _written_by_export(path: Path) -> bool:
    """Whether directory `path` is one an export made (replacing it loses nothing a user made)."""
    entries = list(path.iterdir())
    return (path / _MARK).is_file() or all(p.is_file() and _EXPORT_NAME.fullmatch(p.name) for p in entries)


def _replaceable(out: Path) -> str | None:
    """None if an export may write `out` (replacing what is there), else why not."""
    if _inside_checkpoint(out):
        return f"{out} is inside a checkpoint directory: write the export outside it"
    if not out.exists():
        return None
    if not out.is_dir():
        return f"{out} is a file, not a directory"
    if _holds_checkpoint(out):
        return f"{out} holds a checkpoint (meta.json, rank*.pt or step_* directories): it is never replaced"
    if not any(out.iterdir()) or _written_by_export(out):
        return None
    names = sorted(p.name for p in out.iterdir())
    return (f"{out} holds files no export wrote ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): "
            "choose a new or empty directory, or pass --force to replace it")


def claim_output(out: str | Path, source: str | Path, force: bool = False) -> Path:
    """Check, before any work, that exporting `source` may write directory `out`: never the source or a directory
    holding it, never a checkpoint or a directory inside one; a non-empty directory no export wrote only with
    `force`, which marks it as the export's to replace once the new one is whole. Raises ValueError saying why."""
    out, source = Path(out), Path(source)
    if out.resolve() == source.resolve() or out.resolve() in source.resolve().parents:
        raise ValueError(f"{out}: the output must not be {source}, the checkpoint exported, nor hold it")
    problem = _replaceable(out)
    if problem and force and out.is_dir() and not _holds_checkpoint(out) and not _inside_checkpoint(out):
        (out / _MARK).write_text("replaced by the next export into it (qurl export --force)\n")
        problem = None
    if problem:
        raise ValueError(problem)
    return out


def _fresh_partial(out: Path) -> Path:
    """An empty `<out>.partial` to write into; `_commit` makes it `out`, so `out` appears whole or not at all.
    Fails at once if `out` is not the export's to replace; a `.partial` replaced is only an export's own."""
    problem = _replaceable(out)
    if problem:
        raise ValueError(problem)
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        if not partial.is_dir() or any(partial.iterdir()) and not (partial / _MARK).is_file():
            raise ValueError(f"{partial} exists and no export wrote it: move it away (it is where an export into "
                             f"{out} is written first)")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / _MARK).write_text("written by qurl export; a later export into this directory replaces it\n")
    return partial


def _commit(partial: Path, out: Path) -> Path:
    """Publish `partial` as `out`, replacing `out` only if it is the export's own (`_replaceable`)."""
    problem = _replaceable(out)
    if problem:
        raise ValueError(f"{problem}; the export is left in {partial}")
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def write_hf_checkpoint(model, source_dir: str | Path, out_dir: str | Path, *, uaq_scale: float | None = None,
                        uaq_scope: str = "all", dtype: torch.dtype = torch.bfloat16,
                        bucket_bytes: int = 2 << 30) -> Path | None:
    """Write `model` (this rank's shards; every rank calls this) as an HF checkpoint in `out_dir`, with the
    config and tokenizer of `source_dir`, the checkpoint it was loaded from. `uaq_scale`: the s the model is
    UAQ-scaled by over `uaq_scope`, undone on export. Returns `out_dir` on rank 0, None on the others."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out = Path(out_dir)
    partial = _fresh_partial(out) if rank0 else None
    weight_map: dict[str, str] = {}
    unscale = None if uaq_scale is None else 1.0 / uaq_scale
    for k, bucket in enumerate(export_hf_weights(model, source_dir, bucket_bytes=bucket_bytes, dtype=dtype,
                                                 uaq_scale=unscale, uaq_scope=uaq_scope)):
        if rank0:
            name = f"model-{k + 1:05d}.safetensors"
            save_file({n: t.contiguous().cpu() for n, t in bucket}, str(partial / name), metadata={"format": "pt"})
            weight_map.update({n: name for n, _ in bucket})
    if not rank0:
        return None
    index = {"metadata": {"total_size": sum((partial / f).stat().st_size for f in set(weight_map.values()))},
             "weight_map": dict(sorted(weight_map.items()))}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for name in _MODEL_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copy(Path(source_dir) / name, partial / name)
    config = json.loads((partial / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    return _commit(partial, out)  # whole or absent, like the checkpoints


def unscale_hf_checkpoint(hf_dir: str | Path, out_dir: str | Path, uaq_scale: float, scope: str = "all") -> Path:
    """Rewrite `hf_dir`, an HF checkpoint in the UAQ parameterisation with factor s = `uaq_scale` over UAQ scope
    `scope`, into `out_dir` in the model's usual one: each tensor times s^-k, k its role's exponent
    (`qurl_mcore.uaq.uaq_scale_hf` with 1/s), computed in fp32 and stored in the tensor's own dtype. One
    safetensors file at a time; every other file is copied; `out_dir` appears whole or not at all."""
    src, out = Path(hf_dir), Path(out_dir)
    if not uaq_scale > 0:
        raise ValueError(f"--uaq-scale {uaq_scale}: the UAQ factor s is positive (the run's qurl_uaq_scale, e.g. 1.5)")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src}: no *.safetensors files; expected an HF checkpoint directory "
                                "(slime's --save-hf output)")
    if out.resolve() == src.resolve():
        raise ValueError(f"{out}: the output must not be the input directory (nothing is overwritten in place)")
    partial = _fresh_partial(out)
    rescaled = 0
    config = json.loads((src / "config.json").read_text()) if (src / "config.json").exists() else None  # MLA's heads
    for f in files:
        state = load_file(str(f))
        rescaled += sum(rescales((hf_uaq_role(n),), scope) for n in state)
        save_file({n: uaq_scale_hf(n, t, 1.0 / uaq_scale, config, scope).contiguous() for n, t in state.items()},
                  str(partial / f.name), metadata={"format": "pt"})
    if not rescaled:
        shutil.rmtree(partial)
        raise ValueError(f"{src}: no tensor has a name UAQ rescales (the `uaq` roles of the architecture tables, "
                         f"qurl_mcore.models): only checkpoints of {list(ARCHITECTURES)} are UAQ-scaled")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, partial / f.name)
    return _commit(partial, out)
