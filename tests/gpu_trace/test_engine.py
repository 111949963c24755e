"""An engine's weight push on a fake GPU through SGLang's own loader code (`device_loading_context` around each
layer's restore and re-quantization), with the qurl plugin loaded as SGLang loads it."""
from __future__ import annotations

from qurl_mcore.fakecuda import run_traced

from . import workers


def test_masters_stay_where_they_wait_through_a_push():
    """R3: SGLang stages each layer on the GPU around its restore and sends the re-attached masters there; the
    plugin keeps them out of it, so the push's begin adds no CUDA bytes (without: every host master's) and the
    push ends where it started. master="device": the masters wait on the GPU, and the push moves nothing."""
    pushes = run_traced(workers.engine_pushes, ["host", "device"])
    out = pushes["host"]
    assert out["loaded"] == out["during"] == out["after"] == ["cpu"]
    assert out["restore_bytes"] == out["after_bytes"] == 0 < out["master_bytes"]
    out = pushes["device"]
    assert out["loaded"] == out["during"] == out["after"] == ["cuda:0"]
    assert out["restore_bytes"] == out["after_bytes"] == 0
