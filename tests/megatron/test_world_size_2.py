"""World size 2 over gloo: TP=2 (dense, sequence parallel) and TP=2 × EP=2 (MoE), real Megatron in two
spawned processes, checked against HF transformers and against the same models at world size 1."""
import pytest
import torch

from qurl_mcore.megatron.convert import load_hf_weights
from qurl_mcore.megatron.logprobs import token_logprobs
from qurl_mcore.megatron.gpt import build_gpt
from qurl_mcore.megatron.parallel import spawn
from qurl_mcore.models.tiny import tiny_checkpoint

from . import workers
from .helpers import hf_logits, hf_logprobs, hf_routes, random_ids

pytestmark = pytest.mark.slow  # real engines, process groups or Slurm jobs: `make test`, not test-fast


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _check_common(results, path, ids):
    ref = hf_logits(path, ids)
    for r in results:
        assert r["round_trip"] == []
        assert (r["logits"] - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()
        assert torch.allclose(r["logprobs"][:, 1:], hf_logprobs(path, ids), atol=1e-5, rtol=0)
        assert _rel(r["uaq_logits"], r["logits"]) < 1e-5
    assert torch.equal(results[0]["logits"], results[1]["logits"])


def _check_quantized_matches_ws1(quant, path, ids, precision, scope, fmt):
    """The sharded quantized model agrees with the unsharded one far better than either agrees with bf16."""
    ref = workers.quantized_step(path, ids, precision, scope, fmt)  # world size 1, in this process
    bf16 = build_gpt(path)
    load_hf_weights(bf16, path)
    quant_error = (ref["logprobs"] - token_logprobs(bf16, ids).logprobs).abs().max()
    assert quant_error > 1e-3  # the precision does quantize
    assert (quant["logprobs"] - ref["logprobs"]).abs().max() < min(1e-4, 0.05 * quant_error)
    for g in ("grad_qkv", "grad_proj"):
        assert _rel(quant[g], ref[g]) < 1e-2, g  # gradient quantization may flip a few codes


def test_dense_tp2_sequence_parallel(megatron_ws1):
    path = tiny_checkpoint("qwen3")
    ids = random_ids(2, 16, seed=11)
    results = spawn(workers.dense_tp2, 2, path, ids)
    _check_common(results, path, ids)
    assert all(r["bf16_equals_stock"] for r in results)
    _check_quantized_matches_ws1(results[0]["quant"], path, ids, "fp4_rc", "all", "mxfp4")


def test_moe_tp2_ep2(megatron_ws1):
    path = tiny_checkpoint("qwen3_moe")
    ids = random_ids(2, 16, seed=12)
    results = spawn(workers.moe_tp2_ep2, 2, path, ids)
    _check_common(results, path, ids)
    assert [r["local_experts"] for r in results] == [2, 2]
    assert all(torch.equal(r["routes"], hf_routes(path, ids)) for r in results)
    _check_quantized_matches_ws1(results[0]["quant"], path, ids, "fp4_rc", "experts", "nvfp4")
    # routing replay (R3) under TP=2 with sequence parallelism and EP=2: every token of every layer takes the
    # replayed experts, and the log-probs equal the same replay at world size 1
    model = build_gpt(path)
    load_hf_weights(model, path)
    ref = workers.replayed(model, ids, results[0]["replayed"]["target"])
    for r in results:
        got = r["replayed"]
        assert torch.equal(got["routes"].permute(1, 2, 0, 3).sort(-1).values, got["target"].sort(-1).values)
        assert torch.allclose(got["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
    assert (ref["logprobs"] - results[0]["logprobs"]).abs().max() > 1e-3  # the replay changed the model's output


def test_spawn_reports_a_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        spawn(workers.fail_on_rank_1, 2)


def test_rendezvous_and_gloo_listen_on_loopback_only():
    """torch's TCPStore listens on every interface unless told otherwise (transfer.stores_bound_to_their_address):
    a local trainer group must open nothing a neighbour on the network could reach."""
    for addresses in spawn(workers.listening_addresses, 2):
        assert addresses and set(addresses) == {"127.0.0.1"}, addresses
