"""An engine's weight push on a fake GPU through SGLang's own loader code (`device_loading_context` around each
layer's restore and re-quantization), with the qurl plugin loaded as SGLang loads it."""
from __future__ import annotations

from qurl_mcore.fakecuda import run_traced

from . import workers


def test_host_masters_stay_on_the_host_through_a_push():
    """R3: SGLang stages each layer on the GPU around its restore and sends the re-attached masters there; the
    plugin keeps them out of it, so the push's begin adds no CUDA bytes (without: every master's) and the
    push ends where it started."""
    out = run_traced(workers.engine_push_masters, "host")
    assert out["loaded"] == out["during"] == out["after"] == ["cpu"]
    assert out["restore_bytes"] == out["after_bytes"] == 0 < out["master_bytes"]


def test_device_masters_stay_on_the_device():
    """master="device": the masters wait on the GPU, and the push moves nothing."""
    out = run_traced(workers.engine_push_masters, "device")
    assert out["loaded"] == out["during"] == out["after"] == ["cuda:0"]
    assert out["restore_bytes"] == out["after_bytes"] == 0
