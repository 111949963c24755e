"""SGLang's model classes on its CPU engine compute transformers' model: two that SGLang 0.5.23 cannot run there
without AMX, each with the plugin's completion (qurl_mcore/sglang/cpu.py), and Llama 3.1's RoPE scaling:

- DeepSeek-V3 (MLA): SGLang 0.5.23 would send a prefill to MLA's multi-head path on the torch-native backend and
  fail; the plugin makes it take the absorbed path, q' = [q_nope W_uk, q_pe] against the cached latent and RoPE
  key, then W_uv. The tiny model's MoE layer carries an expert bias that changes the routing (transformers'
  log-probs of the same model without it are 0.04 nat away).
- Qwen2-MoE: its shared-expert gate, y += sigmoid(x·w_gate)·shared(x), is a Triton kernel in SGLang; on host
  tensors the plugin computes it with torch ops.
- Llama with `rope_type: llama3` (SGLang's own llama3 RoPE): the tiny model's head dim puts its wavelengths on
  both sides of the scaling's bands, so some frequencies are divided by 8, some interpolated, some kept.

Each is the same function in exact arithmetic and a different order of sums in fp32, so the engine's log-probs
(fp32 activations, unquantized) are held to transformers' within 5e-6 nat (5 fp32 ulps at log p ≈ −10.8);
measured: 1e-6 at most, prefill and decode, on all three. The tolerance is that tight because the tiny random
models' logits are small (std 0.23): a near variant moves the log-probs little, and each test checks that its
control, where there is one, lies outside it (plain RoPE for Llama 3.1's: 2.6e-5 nat; DeepSeek-V3 without its
expert bias: 0.04). The experts the engine reports are the ones transformers' routers pick.
"""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.models.tiny import tiny_checkpoint
from tests.megatron.helpers import LLAMA3_ROPE, expert_biased_deepseek_v3, hf_logprobs, hf_routes, with_config

from .conftest import local_engine, prompt_ids, score

pytestmark = pytest.mark.slow  # real engines: `make test`, not test-fast

TOL = 5e-6
#: model -> (checkpoint maker, the dense first layers SGLang reports routing rows for and transformers does not
#: (None: a dense model), a near variant the comparison must tell apart (None: none))
MODELS = {"deepseek_v3": (expert_biased_deepseek_v3, 1, "deepseek_v3"),
          "qwen2_moe": (lambda dst: tiny_checkpoint("qwen2_moe"), 0, None),
          "llama3_rope": (lambda dst: with_config(dst, "llama", rope_parameters=LLAMA3_ROPE), None, "llama")}


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, tmp_path_factory):
    make, dense, control = MODELS[request.param]
    path = str(make(tmp_path_factory.mktemp(request.param) / "checkpoint"))
    with local_engine(path, None, return_routed_experts=dense is not None) as engine:
        ids = prompt_ids(path)
        greedy = engine.generate([ids], {"max_new_tokens": 8, "temperature": 0.0})[0]
        yield dict(engine=engine, path=path, prompt=ids, seq=ids + greedy.output_ids, dense=dense,
                   control=control and str(tiny_checkpoint(control)))


def _assert_close(served, got: torch.Tensor):
    ids = torch.tensor([served["seq"][: len(got) + 1]])
    diff = (got - hf_logprobs(served["path"], ids)[0]).abs()
    assert diff.max() < TOL, f"max |Δ| {diff.max():.2e} (mean {diff.mean():.2e})"
    if served["control"]:  # the comparison can fail: the near variant is outside the tolerance
        assert (got - hf_logprobs(served["control"], ids)[0]).abs().max() > 2 * TOL


def test_prefill_logprobs_equal_transformers(served):
    _assert_close(served, score(served["engine"], served["seq"]))


def test_decode_logprobs_equal_transformers(served):
    """Greedy decode steps: one query token against the cache the prefill wrote."""
    g = served["engine"].generate([served["prompt"]], {"max_new_tokens": 8, "temperature": 0.0},
                                  prompt_logprobs=True)[0]
    assert g.prompt_ids + g.output_ids == served["seq"]
    _assert_close(served, torch.tensor(g.prompt_logprobs + g.output_logprobs))


def test_routed_experts_are_transformers_choice(served):
    if served["dense"] is None:
        pytest.skip("a dense model: no experts")
    seq = served["seq"]
    g = served["engine"].generate([seq], {"max_new_tokens": 1, "temperature": 0.0}, routed_experts=True)[0]
    want = hf_routes(served["path"], torch.tensor([seq]))[:, 0]  # [MoE layers, tokens, k]
    got = torch.from_numpy(g.routed_experts.copy()).long()  # [tokens, every layer, k]
    assert got.shape[1] == served["dense"] + want.shape[0]
    assert torch.equal(got[:, served["dense"]:].transpose(0, 1).sort(-1).values, want.sort(-1).values)
