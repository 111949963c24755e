"""How to start an SGLang rollout engine: one dataclass, rendered as `sglang.Engine` kwargs or server argv."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from qurl_mcore.sglang.options import QurlOptions


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """An SGLang engine serving `model_path` (a BF16 HF checkpoint).

    `quantization` is None (BF16) or a qurl method (`qurl_int8`, `qurl_fp8`, `qurl_fp4`, `qurl_fp4_rc`);
    `quant_options` are its options (`fmt`, `scope`, `kernel`, `master`; see qurl_mcore/sglang/options.py).
    `extra` passes any other `sglang.ServerArgs` field through unchanged.
    """

    model_path: str
    quantization: str | None = None
    quant_options: dict[str, Any] = field(default_factory=dict)
    device: str = field(default_factory=_default_device)
    dtype: str = "bfloat16"
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    context_length: int | None = None
    return_routed_experts: bool = False
    random_seed: int = 0
    log_level: str = "warning"
    extra: dict[str, Any] = field(default_factory=dict)

    def options(self) -> QurlOptions | None:
        """The validated qurl options, or None for a BF16 engine."""
        if self.quantization is None:
            if self.quant_options:
                raise ValueError("quant_options given without a qurl quantization method")
            return None
        return QurlOptions.parse(self.quantization, self.quant_options)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `sglang.Engine` (also the source of `server_argv`)."""
        kw: dict[str, Any] = dict(model_path=str(self.model_path), device=self.device, dtype=self.dtype,
                                  random_seed=self.random_seed, log_level=self.log_level, skip_server_warmup=True,
                                  # an idle scheduler otherwise spins one core at 100% (the trainer's core, when
                                  # colocated); it wakes on the next request without delay
                                  sleep_on_idle=True)
        for name in ("mem_fraction_static", "max_total_tokens", "context_length"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        options = self.options()
        if options is not None:
            kw["quantization"] = options.method
            kw["json_model_override_args"] = json.dumps(options.override_args())
            # the shared expert stays linears of its own, as the plugin quantizes, logs and pushes it (see
            # QurlQuantConfig.can_fuse_shared_expert); GLM-4.5's fusion gate never asks the quant config
            kw["disable_shared_experts_fusion"] = True
        if self.return_routed_experts:
            kw["enable_return_routed_experts"] = True
        if self.device == "cpu":  # SGLang's CPU engine runs the torch-native attention only, without graphs
            kw.update(attention_backend="torch_native", disable_cuda_graph=True)
        kw.update(self.extra)
        return kw

    def environment(self) -> dict[str, str]:
        """Environment variables the engine's processes need (SGLang selects its CPU engine by env)."""
        return {"SGLANG_USE_CPU_ENGINE": "1"} if self.device == "cpu" else {}

    def apply_environment(self) -> None:
        os.environ.update(self.environment())

    def server_argv(self, host: str, port: int, config_file: str | None = None) -> list[str]:
        """`python -m sglang.launch_server` arguments for the same engine, listening on host:port; settings
        that must not show in the process list (the API key) come from `config_file`, an SGLang YAML."""
        argv = ["--host", host, "--port", str(port)]
        if config_file:
            argv += ["--config", config_file]
        for key, value in self.engine_kwargs().items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value not in (False, None):
                argv += [flag, str(value)]
        return argv
