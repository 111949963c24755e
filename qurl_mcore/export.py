"""`qurl export`: a run's checkpoint out of the project as an HF checkpoint directory that transformers and
SGLang load as they load the model it was trained from.

Each trainer rank of the run is rebuilt on the CPU, in a process of its own that sees no GPU (gloo between
them: a run of more ranks than this machine has GPUs, any multi-node run, exports on one machine), from the
run's config (recorded in the checkpoint's meta.json) and its slices of the model (torch_dist checkpoints) or
its own file (per-rank torch checkpoints); together they write the model with
`qurl_mcore.megatron.export.write_hf_checkpoint`, which undoes the run's UAQ rescaling. The machine's memory
holds the model once per data-parallel replica of the run, in the ranks' slices.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from qurl_mcore.checkpoint import (
    FORMATS, TRAINER_DIR, format_of, latest_valid, rank_file, read_file, read_meta, verify,
)
from qurl_mcore.config import flatten, load_config
from qurl_mcore.megatron.dist_checkpoint import load_model
from qurl_mcore.megatron.export import write_hf_checkpoint
from qurl_mcore.megatron.gpt import build_gpt
from qurl_mcore.megatron.parallel import destroy_parallel, init_parallel, spawn
from qurl_mcore.models import resolve_model_path


def _export_rank(rank: int, checkpoint_dir: str, out_dir: str, dtype: str) -> str | None:
    """One trainer rank of the run that wrote `checkpoint_dir`, rebuilt on the CPU to export it."""
    meta = read_meta(checkpoint_dir)
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in flatten(meta["config"]).items()])
    init_parallel(cfg.train.tp_size, cfg.train.ep_size, pipeline_parallel=cfg.train.pp_size, rank=rank,
                  world_size=meta["world_size"])
    try:
        source = resolve_model_path(cfg.model.path)
        model = build_gpt(source)  # the stock linears: the parameters are the same whatever the precision
        if FORMATS[format_of(meta)]:
            load_model(model, Path(checkpoint_dir) / TRAINER_DIR)
        else:
            state = read_file(checkpoint_dir, rank_file(rank))["model"]
            model.load_state_dict({k: v for k, v in state.items() if not k.endswith("._extra_state")})
        out = write_hf_checkpoint(model, source, out_dir, uaq_scale=cfg.uaq.scale if cfg.uaq.enabled else None,
                                  uaq_scope=cfg.uaq_scope() or "all",
                                  dtype=getattr(torch, dtype))
        return None if out is None else str(out)
    finally:
        destroy_parallel()


def checkpoint_to_export(checkpoint_dir: str | Path) -> Path:
    """The checkpoint `qurl export CHECKPOINT_DIR` exports: a `step_N` directory itself, or a checkpoint.dir's
    newest one. A damaged newest one is refused, naming it and the newest valid one (give that step_N to
    export it): an export must not pass off an older step as the run's last."""
    path = Path(checkpoint_dir)
    if not (path / "meta.json").is_file():
        found, damaged = latest_valid(path)
        if damaged:
            newest, problem = damaged[0]
            raise ValueError(f"{checkpoint_dir}: the newest checkpoint, {newest.name}, is damaged ({problem})"
                             + (f"; to export the newest valid one, give it: {found}" if found else
                                "; no valid checkpoint there"))
        if found is None:
            raise FileNotFoundError(f"{checkpoint_dir}: no valid checkpoint there")
        path = found
    problem = verify(path)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return path


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Export a run's checkpoint (`checkpoint_to_export`, named on stderr with its step) as an HF checkpoint
    in `out_dir`."""
    path = checkpoint_to_export(checkpoint_dir)
    meta = read_meta(path)
    print(f"qurl export: step {meta['step']} ({path})", file=sys.stderr)
    results = spawn(_export_rank, meta["world_size"], str(path), str(out_dir), dtype, cpu=True)
    return Path(results[0])
