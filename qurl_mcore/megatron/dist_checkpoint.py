"""The trainer's state in Megatron-Core's own distributed checkpoint format (`dist_checkpointing`, backend
`torch_dist`): what Megatron-LM and slime write, and what lets a run resume on another parallel layout.

Every tensor is saved as a `ShardedTensor`: its global name and shape and where this rank's slice sits in it
(the model's `sharded_state_dict()`, and the optimizer's built on it: Adam's moments and fp32 main weights
take the names and slices of their parameters). Loading asks for the slices the *loading* layout holds, so a
checkpoint written at TP=2 loads at TP=1, PP=2 or EP=2. Saving and loading are fully parallel: the slices
held by several data-parallel replicas are written once, spread over the replicas
(`FullyParallelSaveStrategyWrapper`), and on GPUs each replica reads a part and passes it on
(`FullyParallelLoadStrategyWrapper`; on the CPU every rank reads its own slices, since Megatron-Core 0.16
exchanges them through CUDA tensors: `exchange_utils._get_empty_tensor_for_exchange` allocates on "cuda"; its
"gather_object" exchange, the one without CUDA tensors, pickles every slice read: at DP=2 on SmolLM2 it loaded
8x slower with 5x the peak memory of reading one's own slices, `benchmarks/checkpoint_io.py`).

`BackgroundSave` is Megatron's asynchronous save (`checkpoint.async_save`): the rank's slices are staged in host
memory (a device-to-host copy on GPUs), a forked process writes them while training goes on (on the CPU the fork
itself is the snapshot: the parent's later in-place updates do not reach the child's pages), and `wait` joins it
collectively, after which the files are complete.

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
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
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
    optimizer's tensors are named by their parameters whatever the layout (the distributed optimizer's
    state fully reshardable), so any TP/PP/EP/DP loads them."""
    model = _model_state(stack.model)
    # keys without the chained optimizers' "chained_<n>." prefix: a layout with expert parallelism has an expert
    # optimizer of its own beside the dense one, its moments are still named by their parameters
    metadata = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
    return {"model": model,
            "optimizer": stack.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=metadata)}


def _dp_group():
    return ps.get_data_parallel_group(with_context_parallel=True)


def _save_strategy() -> FullyParallelSaveStrategyWrapper:
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(BACKEND), _dp_group())


def save(state: dict[str, Any], directory: str | Path) -> list[str]:
    """Collective over every trainer rank: write sharded state `state` into `directory` (which exists).
    Returns the names (relative to `directory`) of the files this rank wrote."""
    dist_checkpointing.save(state, str(directory), _save_strategy())
    return written_files(directory)


class BackgroundSave:
    """One rank's asynchronous saves, one at a time: `start` returns once the state is staged (its values
    are the ones at `start`, whatever training does next); `wait` blocks until every rank's files are
    written (collective) and returns this rank's file names, like `save`. A save that is never waited for (the
    run failed) stays unpublished; its writer finishes on its own."""

    def __init__(self):
        self._calls = AsyncCallsQueue()
        self.directory: Path | None = None  # where the save in flight writes

    def start(self, state: dict[str, Any], directory: str | Path) -> None:
        """Collective: begin writing `state` into `directory` (which exists)."""
        if self.directory is not None:
            raise RuntimeError(f"a save into {self.directory} is still in flight; wait() for it first")
        request = dist_checkpointing.save(state, str(directory), _save_strategy(), async_sharded_save=True)
        self._calls.schedule_async_request(request)
        self.directory = Path(directory)

    def wait(self) -> list[str]:
        """Collective: the files of the save in flight, once written on every rank ([] if none is)."""
        if self.directory is None:
            return []
        self._calls.maybe_finalize_async_calls(blocking=True)
        directory, self.directory = self.directory, None
        return written_files(directory)


def written_files(directory: str | Path) -> list[str]:
    """The names (relative to `directory`) of the files this rank's save wrote there."""
    directory = Path(directory)
    rank = torch.distributed.get_rank()
    mine = sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += [name for name in SHARED_FILES if (directory / name).is_file()]
    return mine


def load(state: dict[str, Any], directory: str | Path) -> dict[str, Any]:
    """Collective: the values of sharded state `state` (this rank's slices, whatever layout wrote them) read
    from `directory`."""
    strategy = get_default_load_sharded_strategy(str(directory))
    if torch.cuda.is_available():  # Megatron exchanges the slices read through CUDA tensors only
        strategy = FullyParallelLoadStrategyWrapper(strategy, _dp_group())
    return dist_checkpointing.load(state, str(directory), strategy)


def load_training(stack, directory: str | Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective: model weights and optimizer state of `stack` from checkpoint `directory`, on whatever layout
    wrote it; returns the loaded values of `extra` (more sharded state of this rank, e.g. its random
    generators).

    Another layout may split the parameters into another number of optimizers (a dense and an expert one
    with expert parallelism, one without), which the checkpoint's own structure does not fit: the optimizer
    is then loaded in this layout's structure, its tensors (moments, fp32 main weights) and step count from
    the checkpoint, its hyperparameters (learning rate, betas, ...) from this run. Otherwise it is loaded as
    Megatron-LM loads it, hyperparameters included."""
    if not any(key.startswith("optimizer.state.") for key in dist_checkpointing.load_tensors_metadata(str(directory))):
        # saved before the optimizer's first step (every step so far without a learning signal): it had no
        # state, which is what this stack's fresh optimizer holds; its lazily made state is not requested
        loaded = load({"model": _model_state(stack.model), **(extra or {})}, directory)
        stack.model.load_state_dict(loaded["model"])
        return {k: loaded[k] for k in extra or {}}
    request = {**sharded_state(stack, is_loading=True), **(extra or {})}
    wanted = _skeleton(request["optimizer"])  # before `load` replaces factories in place
    loaded = load(request, directory)
    stack.model.load_state_dict(loaded["model"])
    optimizer = loaded["optimizer"]
    if _optimizers(dist_checkpointing.load_common_state_dict(str(directory))["optimizer"]) != _optimizers(wanted):
        optimizer = _fill(wanted, optimizer)
        step = _find(loaded["optimizer"], "common_step")
        if step is not None:
            for sub in _torch_optimizer_states(optimizer):
                sub["state"]["common_step"] = step
    stack.optimizer.load_state_dict(optimizer)
    return {k: loaded[k] for k in extra or {}}


def _optimizers(state: dict) -> int:
    """How many optimizers an optimizer's (sharded) state dict is of: a ChainedOptimizer's has one entry per
    optimizer, keyed 0, 1, ..."""
    return len(state) if state and all(isinstance(k, int) for k in state) else 1


def _skeleton(tree):
    """`tree`'s containers copied, its leaves shared."""
    if isinstance(tree, dict):
        return {k: _skeleton(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_skeleton(v) for v in tree]
    return tree


def _fill(wanted, loaded):
    """`wanted`'s structure: its sharded leaves (and local objects) as `loaded` has them, its plain leaves its own."""
    if isinstance(wanted, dict):
        return {k: _fill(v, loaded.get(k) if isinstance(loaded, dict) else None) for k, v in wanted.items()}
    if isinstance(wanted, list):
        return [_fill(v, loaded[i] if isinstance(loaded, list) and i < len(loaded) else None)
                for i, v in enumerate(wanted)]
    return loaded if isinstance(wanted, (ShardedBase, LocalNonpersistentObject)) else wanted


def _find(tree, key: str):
    """The first value under `key` anywhere in `tree` (None if none)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for value in tree:
            found = _find(value, key)
            if found is not None:
                return found
    return None


def _torch_optimizer_states(tree) -> list[dict]:
    """Every torch optimizer state dict ({"state", "param_groups"}) in `tree`."""
    if isinstance(tree, dict):
        if "state" in tree and "param_groups" in tree:
            return [tree]
        tree = list(tree.values())
    return [sub for value in tree for sub in _torch_optimizer_states(value)] if isinstance(tree, list) else []


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
