"""Broadcast weight pushes (disaggregated layout) into a real SGLang HTTP server on CPU (tiny Llama,
qurl_int8): the trainer side (`WeightSender`, `broadcast_weights`) runs in this process and broadcasts over
gloo while the server receives inside one update session and re-quantizes."""
from __future__ import annotations

import threading

import pytest
import torch

from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.rollout import EngineConfig, HttpEngine, WeightPushError
from qurl_mcore.rollout.broadcast import broadcast_weights, close_weight_group, open_weight_group
from qurl_mcore.rollout.engine import bucket_spec
from qurl_mcore.transfer import buckets, free_port

pytestmark = pytest.mark.slow  # real engines, process groups or Slurm jobs: `make test`, not test-fast

IDS = [1, 504, 3575, 282, 3575, 17, 18, 504, 282, 3575, 17]


@pytest.fixture(scope="module")
def setup():
    from safetensors.torch import load_file

    path = str(tiny_checkpoint("llama"))
    config = EngineConfig(path, "qurl_int8", device="cpu", dtype="float32", mem_fraction_static=0.2,
                          max_total_tokens=4096, context_length=1024)
    engine = HttpEngine.launch(config, startup_timeout=240, timeout=120)
    try:
        sender = open_weight_group([engine], "127.0.0.1", free_port(), group_name="qurl-test", timeout=120)
        try:
            yield engine, sender, load_file(f"{path}/model.safetensors")
        finally:
            close_weight_group(sender, [engine])
    finally:
        engine.shutdown()


def score(engine) -> tuple[torch.Tensor, str]:
    g = engine.generate([IDS], {"max_new_tokens": 1, "temperature": 0.0}, prompt_logprobs=True)[0]
    return torch.tensor(g.prompt_logprobs), g.weight_version


def changed(tensors: dict[str, torch.Tensor], factor: float) -> list[tuple[str, torch.Tensor]]:
    return [(k, (v.float() * factor).to(v.dtype)) for k, v in tensors.items() if k.endswith("proj.weight")]


def test_broadcast_changes_then_restores(setup):
    """The explicit two-sided API: send in a thread, receive_weights with the specs in this one."""
    engine, sender, tensors = setup
    base, _ = score(engine)
    half = list(buckets(changed(tensors, 0.5), 64 << 10))
    assert len(half) > 2
    thread = threading.Thread(target=lambda: [sender.send(bucket) for bucket in half])
    thread.start()
    assert engine.receive_weights([bucket_spec(b) for b in half], "half", "qurl-test") == len(half)
    thread.join(60)
    assert not thread.is_alive()
    halved, version = score(engine)
    assert version == "half" and not torch.equal(halved, base)
    assert broadcast_weights(sender, [engine], buckets(tensors.items(), 1 << 20), "orig") > 1
    restored, version = score(engine)
    assert version == "orig" and torch.equal(restored, base)
    engine.check_version("orig")


def test_broadcast_equals_tensor_push(setup):
    engine, sender, tensors = setup
    gen = torch.Generator().manual_seed(0)
    noisy = [(k, (v.float() * (1 + 0.1 * torch.randn(v.shape, generator=gen))).to(v.dtype))
             for k, v in tensors.items() if k.endswith("proj.weight")]
    engine.push_weights(noisy, "by-tensor", bucket_bytes=256 << 10)
    by_tensor, version = score(engine)
    assert version == "by-tensor"
    engine.push_weights(tensors.items(), "orig")
    assert broadcast_weights(sender, [engine], buckets(noisy, 256 << 10), "by-broadcast") > 1
    by_broadcast, version = score(engine)
    assert version == "by-broadcast" and torch.equal(by_broadcast, by_tensor)
    engine.push_weights(tensors.items(), "orig")


def test_bad_spec_is_refused_and_the_engine_keeps_serving(setup):
    engine, sender, tensors = setup
    engine.push_weights(tensors.items(), "good")
    base, _ = score(engine)
    name = "model.layers.0.self_attn.o_proj.weight"
    bad = [[(name, "bfloat16", [128, 128])], [("model.layers.0.mlp.nope.weight", "bfloat16", [4, 4]),
                                               (name, "bfloat16", [64, 128]), (name, "int8", [128, 128])]]
    with pytest.raises(WeightPushError, match=r"bad weight push \(3\).*nope.*not a tensor of the checkpoint"
                                              r".*shape \[64, 128\] != checkpoint \[128, 128\].*'int8'"):
        engine.receive_weights(bad, "bad", "qurl-test")  # refused before the session: nothing to receive
    engine.check_version("good")
    # streamed: the unknown tensor is in the third bucket; the first two are loaded by then, both sides stop
    # there, and the engine is tagged incomplete
    zero = [[(name, torch.zeros(128, 128, dtype=torch.bfloat16))]]
    pushes = zero * 2 + [[("model.layers.0.mlp.nope.weight", torch.zeros(4, 4, dtype=torch.bfloat16))]] + zero
    with pytest.raises(WeightPushError, match="nope.*not a tensor of the checkpoint"):
        broadcast_weights(sender, [engine], iter(pushes), "bad")
    engine.check_version("incomplete:bad")
    out = engine.generate([IDS], {"max_new_tokens": 4, "temperature": 0.0})[0]
    assert len(out.output_ids) == 4 and out.weight_version == "incomplete:bad"
    assert not torch.equal(score(engine)[0], base)
    # the group is still in step: the next push goes through and restores the engine bitwise
    assert broadcast_weights(sender, [engine], buckets(tensors.items(), 1 << 20), "again") > 1
    restored, version = score(engine)
    assert version == "again" and torch.equal(restored, base)
