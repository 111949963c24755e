"""SGLang's model classes that its CPU engine could not run without AMX compute transformers' model there, with
the plugin's completions (qurl_mcore/sglang/cpu.py):

- DeepSeek-V3 (MLA): SGLang 0.5.23 would send a prefill to MLA's multi-head path on the torch-native backend and
  fail; the plugin makes it take the absorbed path, q' = [q_nope W_uk, q_pe] against the cached latent and RoPE
  key, then W_uv. The tiny model's MoE layer carries an expert bias that changes the routing (transformers'
  log-probs of the same model without it are 0.04 nat away).
- Qwen2-MoE: its shared-expert gate, y += sigmoid(x·w_gate)·shared(x), is a Triton kernel in SGLang; on host
  tensors the plugin computes it with torch ops.

Each is the same function in exact arithmetic and a different order of sums in fp32, so the engine's log-probs
(fp32 activations, unquantized) are held to transformers' within 2e-3 nat, as the quantized engines are held to
their reference (test_engine_numerics.py); measured: 1e-6 nat at most, prefill and decode, on both. The experts
the engine reports are the ones transformers' routers pick.
"""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.models.tiny import tiny_checkpoint
from tests.megatron.helpers import expert_biased_deepseek_v3, hf_logprobs, hf_routes

from .conftest import local_engine, prompt_ids, score

pytestmark = pytest.mark.slow  # real engines: `make test`, not test-fast

TOL = 2e-3
#: model -> (checkpoint maker, the dense first layers SGLang reports routing rows for and transformers does not)
MODELS = {"deepseek_v3": (expert_biased_deepseek_v3, 1),
          "qwen2_moe": (lambda dst: tiny_checkpoint("qwen2_moe"), 0)}


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, tmp_path_factory):
    make, dense = MODELS[request.param]
    path = str(make(tmp_path_factory.mktemp(request.param) / "checkpoint"))
    with local_engine(path, None, return_routed_experts=True) as engine:
        ids = prompt_ids(path)
        greedy = engine.generate([ids], {"max_new_tokens": 8, "temperature": 0.0})[0]
        yield dict(engine=engine, path=path, prompt=ids, seq=ids + greedy.output_ids, dense=dense)


def _assert_close(served, got: torch.Tensor):
    want = hf_logprobs(served["path"], torch.tensor([served["seq"][: len(got) + 1]]))[0]
    diff = (got - want).abs()
    assert diff.max() < TOL, f"max |Δ| {diff.max():.2e} (mean {diff.mean():.2e})"


def test_prefill_logprobs_equal_transformers(served):
    _assert_close(served, score(served["engine"], served["seq"]))


def test_decode_logprobs_equal_transformers(served):
    """Greedy decode steps: one query token against the cache the prefill wrote."""
    g = served["engine"].generate([served["prompt"]], {"max_new_tokens": 8, "temperature": 0.0},
                                  prompt_logprobs=True)[0]
    assert g.prompt_ids + g.output_ids == served["seq"]
    _assert_close(served, torch.tensor(g.prompt_logprobs + g.output_logprobs))


def test_routed_experts_are_transformers_choice(served):
    seq = served["seq"]
    g = served["engine"].generate([seq], {"max_new_tokens": 1, "temperature": 0.0}, routed_experts=True)[0]
    want = hf_routes(served["path"], torch.tensor([seq]))[:, 0]  # [MoE layers, tokens, k]
    got = torch.from_numpy(g.routed_experts.copy()).long()  # [tokens, every layer, k]
    assert got.shape[1] == served["dense"] + want.shape[0]
    assert torch.equal(got[:, served["dense"]:].transpose(0, 1).sort(-1).values, want.sort(-1).values)
