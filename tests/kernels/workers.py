"""Functions run in a process with the fake CUDA runtime (`qurl_mcore.fakecuda.run_traced`)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qurl_mcore.fakecuda import fake_cuda


class _Ops(TorchDispatchMode):
    """The names of the operators that run (qurl's custom ops among them), an FP4 GEMM's with " scaled" where
    it multiplies by `tl.dot_scaled`."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        named = {**dict(zip((a.name for a in func._schema.arguments), args)), **(kwargs or {})}
        self.names.append(func.name() + (" scaled" if named.get("scaled") is True else ""))
        return func(*args, **(kwargs or {}))


def _plugin_layers(device: str, options):
    """An MoE layer's experts (8 of [2·64, 128] and [128, 64]) and a [96, 128] linear, quantized by the qurl
    plugin's methods as an engine's load does, on `device`."""
    from qurl_mcore.sglang import weights
    from qurl_mcore.sglang.linear import QurlLinearMethod
    from qurl_mcore.sglang.moe import QurlFusedMoEMethod

    moe, linear = QurlFusedMoEMethod(options), QurlLinearMethod(options)
    moe.moe_runner_config = SimpleNamespace(apply_router_weight_on_input=False, activation="silu", gemm1_alpha=None)
    experts = SimpleNamespace()
    for name, shape in (("w13_weight", (128, 128)), ("w2_weight", (128, 64))):
        stacked, _ = weights.stack([moe.quantize_weight(torch.randn(shape, device=device) / 8, moe.spec)
                                    for _ in range(8)])
        setattr(experts, f"qurl_{name}", stacked)
    dense = SimpleNamespace(qurl_weight=linear.quantize_weight(torch.randn(96, 128, device=device), linear.spec))
    return moe, experts, linear, dense


def _calls(device: str, method: str, kernel: str, fmt: str) -> dict[str, list[str]]:
    from qurl_mcore.sglang.options import QurlOptions

    options = QurlOptions.parse(method, {"fmt": fmt, "kernel": kernel})
    moe, experts, linear, dense = _plugin_layers(device, options)
    x = torch.randn(4, 128, device=device, dtype=torch.bfloat16)
    topk = (torch.rand(4, 2, device=device), torch.randint(0, 8, (4, 2), device=device, dtype=torch.int32), None)
    out = {}
    with _Ops() as ops:
        y = moe.apply(experts, SimpleNamespace(hidden_states=x, topk_output=topk)).hidden_states
    out["experts"] = [n for n in ops.names if n.startswith("qurl::")] + [f"{y.device.type} {tuple(y.shape)}"]
    with _Ops() as ops:
        y = linear.apply(dense, x)
    out["linear"] = [n for n in ops.names if n.startswith("qurl::")] + [f"{y.device.type} {tuple(y.shape)}"]
    return out


def fp4_kernel_calls(cases: list[tuple[str, str, str, str]]) -> dict[tuple[str, str, str, str], dict[str, list[str]]]:
    """For (fake GPU, method, kernel option, format) cases: the qurl custom ops an engine's FP4 MoE experts and
    FP4 linear run, and their outputs' device and shape."""
    out = {}
    for gpu in dict.fromkeys(case[0] for case in cases):
        with fake_cuda(gpu=gpu):
            out |= {case: _calls("cuda", *case[1:]) for case in cases if case[0] == gpu}
    return out
