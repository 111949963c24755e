"""Rollout engines: generate with behaviour log-probs, push trainer weights, check the served version.

`RolloutEngine` holds the protocol shared by the in-process engine (`LocalEngine`, below) and the HTTP
server (`HttpEngine`, http.py); subclasses only move requests.

A weight push is one SGLang 0.5.23 update session:
  begin_weight_update          quantized layers put their writable full-precision weights back
  update_weights_from_tensor   once per bucket (bounded bytes); the last bucket flushes the prefix cache
  end_weight_update            quantized layers re-quantize (qurl_mcore.quant, as the trainer)
  update_weight_version        the engine tags every later response with `version`
and is verified by reading the version back.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterable

from .buckets import NamedTensor, buckets
from .config import EngineConfig
from .results import Generation, parse

#: default push bucket: 512 MiB bounds the extra memory of one push on both sides
DEFAULT_BUCKET_BYTES = 512 << 20


class WeightPushError(RuntimeError):
    """The engine refused a weight update or serves a different version than the one pushed."""


def _moe_shape(model_path: str) -> tuple[int, int] | None:
    """(layers, top_k) of an MoE checkpoint, from its config.json; None for dense models."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    top_k = config.get("num_experts_per_tok")
    return (config["num_hidden_layers"], top_k) if top_k else None


def _check(result: Any, what: str) -> None:
    """SGLang answers control calls with (success, message) tuples or {"success": ...} dicts."""
    ok, message = (result.get("success"), result.get("message")) if isinstance(result, dict) else result[:2]
    if not ok:
        raise WeightPushError(f"{what} failed: {message}")


class RolloutEngine(ABC):
    """Generation and weight pushes against one SGLang engine."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._moe_shape = _moe_shape(config.model_path)

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
        return [parse(out, ids, self._moe_shape) for out, ids in zip(outs, input_ids)]

    def push_weights(self, named_tensors: Iterable[NamedTensor], version: str, *,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Load full-precision (HF-named) tensors into the engine as weight `version`, in buckets of at most
        `bucket_bytes`; a subset of the weights is a valid (partial) update. Returns the number of buckets."""
        _check(self._control("begin_weight_update"), "begin_weight_update")
        count = 0
        try:
            pending = None  # one bucket of lookahead, so that the last one is known and flushes the cache
            for bucket in buckets(named_tensors, bucket_bytes):
                if pending is not None:
                    _check(self._control("update_weights_from_tensor", named_tensors=pending, flush_cache=False),
                           "update_weights_from_tensor")
                    count += 1
                pending = bucket
            if pending is not None:
                _check(self._control("update_weights_from_tensor", named_tensors=pending, flush_cache=True),
                       "update_weights_from_tensor")
                count += 1
        finally:  # always close the session: the engine re-quantizes whatever it holds and keeps serving
            _check(self._control("end_weight_update"), "end_weight_update")
        self._control("update_weight_version", new_version=str(version))
        self.check_version(version)
        return count

    def check_version(self, version: str) -> None:
        """Raise WeightPushError unless the engine reports serving `version`."""
        served = self.model_info().get("weight_version")
        if served != str(version):
            raise WeightPushError(f"engine serves weight version {served!r}, expected {str(version)!r}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class LocalEngine(RolloutEngine):
    """An in-process `sglang.Engine` (its scheduler runs in a child process)."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        config.apply_environment()  # before sglang spawns its processes
        import sglang

        self.engine = sglang.Engine(**config.engine_kwargs())

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
        self.engine.shutdown()
