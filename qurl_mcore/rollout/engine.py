"""Rollout engines: generate with behaviour log-probs, push trainer weights, check the served version.

`RolloutEngine` holds the protocol shared by the in-process engine (`LocalEngine`, below) and the HTTP
server (`HttpEngine`, http.py); subclasses only move requests.

A weight push is one SGLang 0.5.23 update session:
  begin_weight_update          quantized layers put their writable full-precision weights back
  update_weights_from_tensor   once per bucket (bounded bytes), each flushing the prefix cache (nothing is
                               generated during a push, so a flush is cheap, and no bucket waits for the
                               next one to learn that it is the last)
  end_weight_update            quantized layers re-quantize (qurl_mcore.quant, as the trainer)
  update_weight_version        the engine tags every later response with `version`
and is verified by reading the version back.

In the disaggregated layout (engines on other hosts) the same session receives the tensors by broadcast
instead: the engine joins a torch.distributed group with the trainer's rank 0 (`join_weight_group`), and
`receive_weights` runs `update_weights_from_distributed` per bucket while the trainer broadcasts them
(`qurl_mcore.rollout.broadcast`, which runs both sides together). A bucket travels as one byte buffer (SGLang's
flattened bucket), so a code push's int8, float8 and uint8 codes and scales cross as BF16 weights do.
"""
from __future__ import annotations

import json
import os
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from safetensors import safe_open

from qurl_mcore.transfer import NamedTensor, buckets, dtype_name

from qurl_mcore.sglang.weights import DIGESTS

from .codes import CodePush, compare_digests, engine_units, push_specs
from .engine_config import EngineConfig
from .results import Generation, parse_batch

#: default push bucket: 512 MiB bounds the extra memory of one push on both sides
DEFAULT_BUCKET_BYTES = 512 << 20
#: what an engine can release while it is idle (SGLang's memory-saver tags; constants.GPU_MEMORY_TYPE_*)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class WeightPushError(RuntimeError):
    """The engine refused a weight update or serves a different version than the one pushed; `engine` is
    the index of the engine at fault when a push to several engines knows it."""

    def __init__(self, message: str, engine: int | None = None):
        super().__init__(message)
        self.engine = engine

    def __reduce__(self):  # crosses process boundaries inside Ray errors
        return WeightPushError, (str(self), self.engine)


class WeightSpecError(WeightPushError):
    """A push names a tensor the checkpoint does not have, or gives it another shape or a non-float dtype:
    the sender's export is wrong, not the engine (no restart fixes it)."""

    def __reduce__(self):
        return WeightSpecError, (str(self), self.engine)


class RefitMismatch(WeightSpecError):
    """After a push the engine serves other codes than the trainer quantized (`rollout.verify_push`): the two
    sides disagree on what is quantized or how, which no restart fixes."""

    def __reduce__(self):
        return RefitMismatch, (str(self), self.engine)


def moe_shape(model_path: str) -> tuple[int, int] | None:
    """(layers, top_k) of an MoE checkpoint, from its config.json; None for dense models."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    top_k = config.get("num_experts_per_tok")
    return (config["num_hidden_layers"], top_k) if top_k else None


#: one bucket of a broadcast push: (HF name, torch dtype name without "torch.", shape) per tensor, in the
#: order the sender lays them out (`wire_order`)
BucketSpec = Sequence[tuple[str, str, Sequence[int]]]
#: SGLang's receive of a broadcast bucket as one byte buffer, cut into its tensors by the bucket's spec
FLATTENED = "flattened_bucket"


def wire_order(bucket: Iterable[NamedTensor]) -> list[NamedTensor]:
    """A bucket's tensors in the order a broadcast push lays them end to end in one byte buffer (SGLang's
    flattened bucket, `FlattenedTensorBucket`): by element size, largest first, so that each starts at a multiple
    of its element size, which SGLang's receive requires (fp32 scales, then bf16 weights, then 1-byte codes)."""
    return sorted(bucket, key=lambda nt: -nt[1].element_size())


def bucket_spec(bucket: Iterable[NamedTensor]) -> list[tuple[str, str, list[int]]]:
    """(name, dtype name, shape) of each tensor of a bucket, in `wire_order`: what `check_specs` validates and what
    the receiving side of a broadcast push passes to `update_weights_from_distributed`."""
    return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in wire_order(bucket)]


def _checkpoint_shapes(model_path: str) -> dict[str, list[int]] | None:
    """HF tensor name -> shape from the safetensors headers of a checkpoint (no tensor data is read); None
    when the directory holds no safetensors files."""
    shapes: dict[str, list[int]] = {}
    files = sorted(Path(model_path).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for name in handle.keys():
                shapes[name] = list(handle.get_slice(name).get_shape())
    return shapes if files else None


def _check(result: Any, what: str) -> None:
    """SGLang answers control calls with (success, message) tuples or {"success": ...} dicts."""
    ok, message = (result.get("success"), result.get("message")) if isinstance(result, dict) else result[:2]
    if not ok:
        raise WeightPushError(f"{what} failed: {message}")


class RolloutEngine(ABC):
    """Generation and weight pushes against one SGLang engine."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._moe_shape = moe_shape(config.model_path)
        self._specs: dict[str, tuple[Any, list[int]]] | None = None  # what a push may send, read on first use

    # -- transport, per engine kind ---------------------------------------------------------------------
    @abstractmethod
    def _generate(self, input_ids: list[list[int]], sampling: dict, extra: dict) -> list[dict]: ...

    @abstractmethod
    def _control(self, call: str, **kwargs) -> Any:
        """One control call by its SGLang name (begin_weight_update, update_weights_from_tensor, ...)."""

    @abstractmethod
    def model_info(self) -> dict: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    # -- the protocol -------------------------------------------------------------------------------------
    def generate(self, input_ids: list[list[int]], sampling: dict | None = None, *, prompt_logprobs: bool = False,
                 routed_experts: bool = False) -> list[Generation]:
        """Sample one completion per prompt (token ids) with SGLang sampling params (`max_new_tokens`,
        `temperature`, `top_p`, ...). Behaviour log-probs always come back; `prompt_logprobs` adds the
        teacher-forced log-probs of the prompt tokens; `routed_experts` the MoE routing per token."""
        if routed_experts and not self.config.return_routed_experts:
            raise ValueError("start the engine with EngineConfig(return_routed_experts=True) to get routed experts")
        extra: dict[str, Any] = {"return_logprob": True}
        if prompt_logprobs:
            extra["logprob_start_len"] = 0
        if routed_experts:
            extra["return_routed_experts"] = True
        outs = self._generate([list(ids) for ids in input_ids], dict(sampling or {}), extra)
        return parse_batch(outs, input_ids, self._moe_shape)

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks of the engine: its ranks in a weight group."""
        return int(self.config.extra.get("tp_size", 1))

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks of the engine (SGLang's ep_size: its TP ranks split the routed experts)."""
        return int(self.config.extra.get("ep_size", 1))

    def _update_session(self, call: str, updates: Iterable[dict], version: str) -> int:
        """One SGLang update session: begin_weight_update, `call` with each kwargs of `updates` (one bucket
        each, taken from `updates` only when it is sent, so a generator streams), end_weight_update
        (re-quantization), then tag and verify `version`. Returns the number of buckets.

        The session is always closed, so the engine keeps serving. If it fails once a bucket has gone in,
        the engine holds a mix of old and new weights and is tagged `incomplete:<version>`, so that no
        later generation passes for either version."""
        _check(self._control("begin_weight_update"), "begin_weight_update")
        count = 0
        try:
            for kwargs in updates:
                count += 1
                _check(self._control(call, **kwargs, flush_cache=True), call)
        except BaseException:
            _check(self._control("end_weight_update"), "end_weight_update")
            if count:
                self._control("update_weight_version", new_version=f"incomplete:{version}")
            raise
        _check(self._control("end_weight_update"), "end_weight_update")
        self._control("update_weight_version", new_version=str(version))
        self.check_version(version)
        return count

    def push_weights(self, named_tensors: Iterable[NamedTensor], version: str, *,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Load full-precision (HF-named) tensors into the engine as weight `version`, in buckets of at most
        `bucket_bytes`, each validated (`check_specs`) before it is sent and sent as soon as it is full: a
        generator of tensors streams, one bucket held at a time. A subset of the weights is a valid (partial)
        update. Returns the number of buckets."""
        def checked() -> Iterator[dict]:
            for bucket in buckets(named_tensors, bucket_bytes):
                self.check_specs([bucket_spec(bucket)])
                yield {"named_tensors": bucket}

        return self._update_session("update_weights_from_tensor", checked(), version)

    # -- memory, for a trainer on the same GPU ----------------------------------------------------------
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the GPU memory of `tags` (of MEMORY_TAGS) while the engine is idle (SGLang's
        release_memory_occupation; on GPUs the engine needs `enable_memory_saver`). Released weights are
        garbage until resumed and pushed again; a released KV cache holds nothing (the prefix cache is
        flushed)."""
        self._control("release_memory_occupation", tags=list(tags))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Take back the memory of released `tags`: weights before a push, the KV cache and CUDA graphs
        before generating."""
        self._control("resume_memory_occupation", tags=list(tags))

    # -- broadcast pushes (disaggregated layout) ---------------------------------------------------------
    def join_weight_group(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str) -> None:
        """Join the torch.distributed group `group_name` (TCP rendezvous at master_addr:master_port) as ranks
        rank_offset .. rank_offset + tp_size - 1 of `world_size`; the sender is rank 0. Blocks until every
        member joins, so run it concurrently with `WeightSender.connect` and the other engines' joins."""
        _check(self._control("init_weights_update_group", master_address=master_addr, master_port=int(master_port),
                             rank_offset=int(rank_offset), world_size=int(world_size), group_name=group_name,
                             backend=backend), "init_weights_update_group")

    def check_specs(self, bucket_specs: Iterable[BucketSpec]) -> list[BucketSpec]:
        """Validate a push before anything moves: every entry is (name, floating dtype, shape)
        and -- when the engine's checkpoint directory holds safetensors -- every name is a checkpoint tensor
        of that shape (SGLang would skip an unknown name silently). Returns the specs as a list; raises
        WeightPushError naming the bad entries."""
        return list(self._checked(bucket_specs))

    def _checked(self, bucket_specs: Iterable[BucketSpec]) -> Iterator[BucketSpec]:
        """The buckets of `bucket_specs` one by one, each validated before it is handed on."""
        if self._specs is None:
            self._specs = self._push_specs()
        for bucket in bucket_specs:
            bucket, errors = list(bucket), []
            for entry in bucket:
                try:
                    name, dtype, shape = entry
                    ok_shape = all(isinstance(n, int) and n >= 0 for n in shape)
                except (TypeError, ValueError):
                    errors.append(f"{entry!r} is not (name, dtype, shape)")
                    continue
                want_dtype, want_shape = self._specs.get(name, (None, None))
                torch_dtype = getattr(torch, dtype_name(dtype), None)
                if want_dtype is not None and torch_dtype != want_dtype:
                    errors.append(f"{name}: dtype {dtype!r} != the code push's {dtype_name(want_dtype)}")
                elif want_dtype is None and (not isinstance(torch_dtype, torch.dtype) or
                                             not torch_dtype.is_floating_point):
                    errors.append(f"{name}: dtype {dtype!r} is not a floating torch dtype")
                if not ok_shape:
                    errors.append(f"{name}: shape {shape!r} is not a list of sizes")
                elif self._specs and want_shape is None:
                    errors.append(f"{name}: not a tensor of the checkpoint" + (" (a code push sends codes of "
                                  "quantized weights only)" if self.codes else ""))
                elif self._specs and list(shape) != want_shape:
                    errors.append(f"{name}: shape {list(shape)} != {'the code push' if self.codes else 'checkpoint'}"
                                  f" {want_shape}")
            if errors:
                raise WeightSpecError(f"bad weight push ({len(errors)}): " + "; ".join(errors[:10]))
            yield bucket

    @property
    def codes(self) -> bool:
        """Whether this engine takes code pushes (its `push: codes` option)."""
        options = self.config.options()
        return options is not None and options.codes

    def _push_specs(self) -> dict[str, tuple[Any, list[int]]]:
        """name -> (dtype or None: any floating dtype, shape) of every tensor a push may send: the checkpoint's
        tensors, or for a code push the wire tensors of the weights the engine quantizes (`codes.push_specs`);
        empty when the engine's directory holds no safetensors (nothing is checked then)."""
        shapes = _checkpoint_shapes(self.config.model_path) or {}
        if not (self.codes and shapes):
            return {name: (None, shape) for name, shape in shapes.items()}
        recipe = self.config.options().recipe
        units = engine_units(self.config.model_path, recipe.groups, self.tp_size, self.ep_size)
        return push_specs(shapes, recipe.spec, units)

    def installed_digests(self) -> dict[str, str]:
        """HF name of each quantized unit's first weight -> the digest of the codes and scales the engine serves
        (`qurl_mcore.quant.wire.digest`; empty for a full-precision engine)."""
        return self._control("get_weights_by_name", name=DIGESTS, truncate_size=0) or {}

    def verify_push(self, push: CodePush) -> None:
        """Raise RefitMismatch naming every unit whose installed codes are not the ones `push` quantized (a unit
        quantized on one side only included): the refit check of `rollout.verify_push`."""
        problems = compare_digests(push, self.installed_digests())
        if problems:
            raise RefitMismatch(f"the engine's weights differ from the trainer's after the push ({len(problems)} "
                                f"units): " + "; ".join(problems[:10]))

    def receive_weights(self, bucket_specs: Iterable[BucketSpec], version: str, group_name: str) -> int:
        """Receive a broadcast push over `group_name` as weight `version`: one update session with
        `update_weights_from_distributed` per bucket spec (`bucket_spec` of each bucket sent). Each
        call blocks until the sender broadcasts that bucket, so `WeightSender.send` of the same buckets must
        run at the same time, in another thread or process (`broadcast.broadcast_weights` does both).

        A list of specs is validated whole (`check_specs`) before the session opens, so a bad one raises
        WeightPushError with the engine untouched and nothing received -- validate before starting the
        sender, or it waits for receivers that never come. An iterator is consumed (and validated) bucket
        by bucket, for streaming: a bad bucket then ends the session early, without a version. Returns the
        number of buckets."""
        specs = self.check_specs(bucket_specs) if isinstance(bucket_specs, Sequence) else self._checked(bucket_specs)
        updates = ({"names": [e[0] for e in bucket], "dtypes": [dtype_name(e[1]) for e in bucket],
                    "shapes": [list(e[2]) for e in bucket], "group_name": group_name, "load_format": FLATTENED}
                   for bucket in specs if bucket)
        return self._update_session("update_weights_from_distributed", updates, version)

    def leave_weight_group(self, group_name: str) -> None:
        """Leave (destroy) the weight group on the engine side."""
        _check(self._control("destroy_weights_update_group", group_name=group_name), "destroy_weights_update_group")

    def check_version(self, version: str) -> None:
        """Raise WeightPushError unless the engine reports serving `version`."""
        served = self.model_info().get("weight_version")
        if served != str(version):
            raise WeightPushError(f"engine serves weight version {served!r}, expected {str(version)!r}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


#: held while a LocalEngine shuts down (its swap of SGLang's process-tree kill)
_SHUTDOWN = threading.Lock()


class LocalEngine(RolloutEngine):
    """An in-process `sglang.Engine` (its scheduler runs in a child process)."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        config.apply_environment()  # before sglang spawns its processes
        import sglang

        before = _child_pids()
        self.engine = sglang.Engine(**config.engine_kwargs())
        self._processes = sorted(_child_pids() - before)  # its scheduler(s) and detokenizer

    def _generate(self, input_ids, sampling, extra):
        return self.engine.generate(input_ids=input_ids, sampling_params=sampling, **extra)

    def _control(self, call, **kwargs):
        if call == "update_weight_version":  # the python Engine has no method for it (0.5.23)
            from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

            tm = self.engine.tokenizer_manager
            return self.engine.loop.run_until_complete(tm.update_weight_version(UpdateWeightVersionReqInput(**kwargs)))
        return getattr(self.engine, call)(**kwargs)

    def model_info(self) -> dict:
        return self.engine.get_model_info()

    def shutdown(self) -> None:
        """Stop the engine and the processes it started, and no other. SGLang 0.5.23's `Engine.shutdown`
        SIGKILLs every descendant of this process, whoever started it (a trainer's checkpoint writer, Megatron's
        multiprocessing Manager, data loader workers): its process-tree kill is pointed at this engine's own
        children for the duration of the call. One engine shuts down at a time (`_SHUTDOWN`): two threads
        swapping the function at once would each kill the other's processes and leave the swap behind."""
        from sglang.srt.entrypoints import engine as sglang_engine

        with _SHUTDOWN:
            kill_tree = sglang_engine.kill_process_tree

            def kill_own(parent_pid, include_parent=True, **kw):
                if parent_pid in (None, os.getpid()) and not include_parent:
                    for pid in self._processes:
                        kill_tree(pid, include_parent=True, **kw)
                else:
                    kill_tree(parent_pid, include_parent=include_parent, **kw)

            sglang_engine.kill_process_tree = kill_own
            try:
                self.engine.shutdown()
            finally:
                sglang_engine.kill_process_tree = kill_tree


def _child_pids() -> set[int]:
    import psutil  # an SGLang dependency

    return {p.pid for p in psutil.Process().children()}
