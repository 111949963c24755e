"""A code push into a real SGLang engine (CPU, TP 1) leaves every quantized tensor bitwise what a BF16 push and the
engine's re-quantization leave, whole and bucketed, full and partial; the refit check passes on both and names a
layer quantized by one side only (verl PR 7519's case); by broadcast (the disaggregated layout) it installs what
it installs by tensor. Two engine starts per case: the slow lane."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.recipe import engine_recipe
from qurl_mcore.rollout.broadcast import broadcast_weights, close_weight_group, open_weight_group
from qurl_mcore.rollout.codes import CodePush, engine_units
from qurl_mcore.rollout.engine import RefitMismatch
from qurl_mcore.transfer import buckets, free_port
from tests.sglang.conftest import checkpoint_tensors, local_engine, model_path, noisy_layer0, prompt_ids, score

pytestmark = pytest.mark.slow

#: (model, method, format, scope): every format, dense and MoE, both scopes, and MLA under scope all (its engine
#: rebuilds the decode weights from the kv_b_proj pushed beside the codes, which the log-probs see)
CASES = [("qwen3_moe", "qurl_int8", "int8", "all"), ("deepseek_v3", "qurl_int8", "int8", "all"),
         ("qwen3", "qurl_fp8", "fp8_e4m3", "all"),
         ("qwen3_moe", "qurl_fp4", "nvfp4", "all"), ("qwen3", "qurl_fp4_rc", "mxfp4", "all"),
         ("qwen3_moe", "qurl_fp4_rc", "mxfp4", "experts"), ("qwen3_moe", "qurl_fp4_rc", "hif4", "all")]
#: small buckets, so that units straddle them
BUCKET = 96 << 10


def _stream(tensors: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    return list(buckets(tensors.items(), BUCKET))


def _pushes(path: str, method: str, fmt: str, scope: str, push: str) -> dict:
    """Digests and log-probs after a full push of noisy weights and after a partial push of one unit's rows."""
    recipe = engine_recipe(method, fmt, scope)
    units = engine_units(path, recipe.groups)
    full = {k: v.to(torch.bfloat16) for k, v in noisy_layer0(checkpoint_tensors(path)).items()}
    part = sorted(units)[-1]  # one weight (a whole unit for NVFP4)
    partial = {n: full[n] * 1.5 for n in units[part].names} if fmt == "nvfp4" else {part: full[part] * 1.5}
    out = {}
    with local_engine(path, method, {"fmt": fmt, "scope": scope, "push": push}, dtype="bfloat16") as engine:
        ids = prompt_ids(path)
        for step, tensors in (("full", full), ("partial", partial)):
            codes = CodePush(recipe.spec, units, send=push == "codes")
            engine.push_weights((nt for b in codes.buckets(_stream(tensors)) for nt in b), version=step,
                                bucket_bytes=BUCKET)
            engine.verify_push(codes)
            out[step] = engine.installed_digests(), score(engine, ids)
        if push == "bf16":  # the trainer believes layer 0's o_proj (or an expert's down) is not quantized
            lone = next(n for n, u in units.items() if len(u.names) == 1 and ".layers.0." in n)
            believed = CodePush(recipe.spec, {n: u for n, u in units.items() if n != lone}, send=False)
            engine.push_weights((nt for b in believed.buckets(_stream(full)) for nt in b), version="mismatch")
            with pytest.raises(RefitMismatch, match=rf"{lone}: quantized by the engine only"):
                engine.verify_push(believed)
    return out


@pytest.mark.parametrize("arch,method,fmt,scope", CASES)
def test_a_code_push_installs_what_a_bf16_push_and_requantization_install(arch, method, fmt, scope):
    path = model_path(arch)
    bf16 = _pushes(path, method, fmt, scope, "bf16")
    codes = _pushes(path, method, fmt, scope, "codes")
    for step in ("full", "partial"):
        (want, want_lp), (got, got_lp) = bf16[step], codes[step]
        assert got and got == want, step
        assert torch.equal(got_lp, want_lp), step
    assert bf16["full"][0] != bf16["partial"][0]  # the partial push changed a unit


def test_a_code_push_over_http_leaves_an_engine_serving_its_checkpoint_bitwise_unchanged():
    """The loop's path: codes and scales through the HTTP server's tensor handles (int8/float8/uint8 and 0-dim
    tensors), and the refit check's digests through its `get_weights_by_name`."""
    from qurl_mcore.rollout import EngineConfig, HttpEngine

    path = model_path("qwen3_moe")
    recipe = engine_recipe("qurl_fp4", "nvfp4", "all")
    config = EngineConfig(path, "qurl_fp4", {"fmt": "nvfp4", "scope": "all", "push": "codes"}, device="cpu",
                          dtype="bfloat16", mem_fraction_static=0.2, max_total_tokens=4096, context_length=1024)
    engine = HttpEngine.launch(config, startup_timeout=240, timeout=120)
    try:
        ids = prompt_ids(path)
        before = score(engine, ids)
        codes = CodePush(recipe.spec, engine_units(path, recipe.groups))
        engine.push_weights((nt for b in codes.buckets(_stream(checkpoint_tensors(path))) for nt in b),
                            version="same", bucket_bytes=BUCKET)
        engine.verify_push(codes)
        assert len(codes.digests) == len(engine.installed_digests()) > 0
        assert torch.equal(score(engine, ids), before)
    finally:
        engine.shutdown()


def test_a_code_push_by_broadcast_installs_what_the_same_push_by_tensor_installs():
    """The disaggregated layout's path: NVFP4 codes (uint8), E4M3 scales (which gloo cannot broadcast as float8) and
    fp32 global scales broadcast over gloo a bucket at a time as one byte buffer into an HTTP server, which installs
    them with the loaders of a tensor push: the same codes, digests and log-probs, and the refit check passes."""
    from qurl_mcore.rollout import EngineConfig, HttpEngine

    path = model_path("qwen3_moe")
    recipe = engine_recipe("qurl_fp4", "nvfp4", "all")
    units = engine_units(path, recipe.groups)
    original = checkpoint_tensors(path)
    noisy = {k: v.to(torch.bfloat16) for k, v in noisy_layer0(original).items()}
    config = EngineConfig(path, "qurl_fp4", {"fmt": "nvfp4", "scope": "all", "push": "codes"}, device="cpu",
                          dtype="bfloat16", mem_fraction_static=0.2, max_total_tokens=4096, context_length=1024)
    engine = HttpEngine.launch(config, startup_timeout=240, timeout=120)
    try:
        ids = prompt_ids(path)
        by_tensor = CodePush(recipe.spec, units)
        engine.push_weights((nt for b in by_tensor.buckets(_stream(noisy)) for nt in b), "tensor", bucket_bytes=BUCKET)
        engine.verify_push(by_tensor)
        want = engine.installed_digests(), score(engine, ids)
        engine.push_weights((nt for b in CodePush(recipe.spec, units).buckets(_stream(original)) for nt in b), "orig")
        assert engine.installed_digests() != want[0]
        sender = open_weight_group([engine], "127.0.0.1", free_port(), group_name="qurl-codes", timeout=120)
        try:
            by_broadcast = CodePush(recipe.spec, units)
            sent = [b for b in by_broadcast.buckets(_stream(noisy))]
            assert torch.float8_e4m3fn in {t.dtype for b in sent for _, t in b}
            assert broadcast_weights(sender, [engine], sent, "broadcast") == len(sent) > 1
            engine.verify_push(by_broadcast)
            got = engine.installed_digests(), score(engine, ids)
        finally:
            close_weight_group(sender, [engine])
        assert by_broadcast.digests == by_tensor.digests
        assert got[0] == want[0] and torch.equal(got[1], want[1])
    finally:
        engine.shutdown()
