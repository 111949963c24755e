"""The trainer's state in Megatron-Core's own distributed checkpoint format (`dist_checkpointing`, backend
`torch_dist`): what Megatron-LM and slime write, and what lets a run resume on another parallel layout.

Every tensor is saved as a `ShardedTensor`: its global name and shape and where this rank's slice sits in it
(the model's `sharded_state_dict()`, and the optimizer's built on it: Adam's moments and fp32 main weights
take the names and slices of their parameters). Loading asks for the slices the *loading* layout holds, so a
checkpoint written at TP=2 loads at TP=1, PP=2 or EP=2. Saving and loading are fully parallel: the slices
held by several data-parallel replicas are written once, spread over the replicas
(`FullyParallelSaveStrategyWrapper`), and each replica reads a part and passes it on
(`FullyParallelLoadStrategyWrapper`).

Layout of one checkpoint directory (Megatron's): `metadata.json` (the backend), `common.pt` (rank 0: every
non-tensor value), `.metadata` (the global index of every slice, written by the coordinator) and
`__<rank>_<n>.distcp` (the slices rank `<rank>` wrote).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

#: the backend written, as recorded in a checkpoint's metadata.json
BACKEND = "torch_dist"
#: the files a `save` writes besides the ranks' slices (rank 0 and the coordinator write them)
SHARED_FILES = ("metadata.json", "common.pt", ".metadata")
#: the file of a Megatron-LM `--save` directory that names its newest iteration
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    return model.sharded_state_dict()


def sharded_state(stack, is_loading: bool = False) -> dict[str, Any]:
    """The training stack's sharded state: {"model": ..., "optimizer": ...} (Megatron-LM's keys). The
    distributed optimizer's state is described fully reshardable (any TP/PP/EP/DP on load)."""
    model = _model_state(stack.model)
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    return {"model": model,
            "optimizer": stack.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=metadata)}


def _dp_group():
    return ps.get_data_parallel_group(with_context_parallel=True)


def save(state: dict[str, Any], directory: str | Path) -> list[str]:
    """Collective over every trainer rank: write sharded state `state` into `directory` (which exists).
    Returns the names (relative to `directory`) of the files this rank wrote."""
    directory = Path(directory)
    strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(BACKEND), _dp_group())
    dist_checkpointing.save(state, str(directory), strategy)
    rank = torch.distributed.get_rank()
    mine = sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += [name for name in SHARED_FILES if (directory / name).is_file()]
    return mine


def load(state: dict[str, Any], directory: str | Path) -> dict[str, Any]:
    """Collective: the values of sharded state `state` (this rank's slices, whatever layout wrote them) read
    from `directory`."""
    strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(directory)), _dp_group())
    return dist_checkpointing.load(state, str(directory), strategy)


def checkpoint_dir(path: str | Path) -> Path:
    """The torch_dist checkpoint that `path` names: itself (it holds metadata.json), or the newest iteration of
    a Megatron-LM or slime `--save` directory (its latest_checkpointed_iteration.txt)."""
    path = Path(path)
    if (path / MEGATRON_LATEST).is_file():
        latest = (path / MEGATRON_LATEST).read_text().strip()
        path = path / (latest if latest == "release" else f"iter_{int(latest):07d}")
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a torch_dist checkpoint (it has no metadata.json): give a directory "
                                f"Megatron's dist_checkpointing.save wrote (a qurl run's: step_N/trainer), or a --save "
                                f"directory with {MEGATRON_LATEST}")
    return path


def load_model(model: torch.nn.Module, path: str | Path) -> None:
    """Collective: `model`'s weights (this rank's slices) from the torch_dist checkpoint at `path`
    (`checkpoint_dir`), one of ours or Megatron-LM's (its model is the same state under the same key,
    "model"), on whatever layout wrote it; nothing else of the checkpoint is read (optimizer, random
    generators, step)."""
    model.load_state_dict(load({"model": _model_state(model)}, checkpoint_dir(path))["model"])
