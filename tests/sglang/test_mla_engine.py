"""SGLang's DeepSeek-V3 (MLA) engine on the CPU's torch-native attention backend computes transformers' model.

SGLang 0.5.23 would run a prefill through MLA's multi-head path there and fail (qurl_mcore/sglang/cpu.py); the
plugin makes it take the absorbed path, q' = [q_nope W_uk, q_pe] against the cached latent and RoPE key, then
W_uv. That is the same function in exact arithmetic and a different order of sums in fp32, so the engine's
log-probs (fp32 activations, unquantized) are held to transformers' within 2e-3 nat, as the quantized engines
are held to their reference (test_engine_numerics.py); measured: 1e-6 nat at most, prefill and decode. The MoE
layer carries an expert bias that changes the routing (transformers' log-probs of the same model without it
are 0.04 nat away), and the experts the engine reports are the ones transformers' router picks.
"""
from __future__ import annotations

import pytest
import torch

from tests.megatron.helpers import expert_biased_deepseek_v3, hf_logprobs, hf_routes

from .conftest import local_engine, prompt_ids, score

pytestmark = pytest.mark.slow  # a real engine: `make test`, not test-fast

TOL = 2e-3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(expert_biased_deepseek_v3(tmp_path_factory.mktemp("mla") / "biased"))
    with local_engine(path, None, return_routed_experts=True) as engine:
        ids = prompt_ids(path)
        greedy = engine.generate([ids], {"max_new_tokens": 8, "temperature": 0.0})[0]
        yield dict(engine=engine, path=path, prompt=ids, seq=ids + greedy.output_ids)


def _reference(served, n: int) -> torch.Tensor:
    return hf_logprobs(served["path"], torch.tensor([served["seq"][: n + 1]]))[0]


def test_prefill_logprobs_equal_transformers(served):
    got = score(served["engine"], served["seq"])
    diff = (got - _reference(served, len(got))).abs()
    assert diff.max() < TOL, f"max |Δ| {diff.max():.2e} (mean {diff.mean():.2e})"


def test_decode_logprobs_equal_transformers(served):
    """Greedy decode steps: one query token against the cache the prefill wrote."""
    g = served["engine"].generate([served["prompt"]], {"max_new_tokens": 8, "temperature": 0.0},
                                  prompt_logprobs=True)[0]
    assert g.prompt_ids + g.output_ids == served["seq"]
    got = torch.tensor(g.prompt_logprobs + g.output_logprobs)
    diff = (got - _reference(served, len(got))).abs()
    assert diff.max() < TOL, f"max |Δ| {diff.max():.2e} (mean {diff.mean():.2e})"


def test_routed_experts_are_transformers_expert_biased_choice(served):
    seq = served["seq"]
    g = served["engine"].generate([seq], {"max_new_tokens": 1, "temperature": 0.0}, routed_experts=True)[0]
    want = hf_routes(served["path"], torch.tensor([seq]))[:, 0]  # [MoE layers, tokens, k]
    got = torch.from_numpy(g.routed_experts.copy()).long()  # [tokens, every layer, k]
    dense = got.shape[1] - want.shape[0]  # the first layers are dense: rows the trainer never routes
    assert dense == 1
    assert torch.equal(got[:, dense:].transpose(0, 1).sort(-1).values, want.sort(-1).values)
