import pytest
import torch

from qurl_mcore.megatron.convert import load_hf_weights
from qurl_mcore.megatron.logprobs import attention_mask_for, token_logprobs
from qurl_mcore.megatron.gpt import build_gpt
from qurl_mcore.models.tiny import tiny_checkpoint

from .helpers import hf_logprobs, hf_routes, random_ids


@pytest.fixture(scope="module")
def moe(megatron_ws1):
    path = tiny_checkpoint("qwen3_moe")
    model = build_gpt(path)
    load_hf_weights(model, path)
    return path, model


def test_logprobs_equal_hf_log_softmax(moe):
    path, model = moe
    ids = random_ids(2, 20)
    out = token_logprobs(model, ids)
    assert out.mask[:, 0].logical_not().all() and out.mask[:, 1:].all()
    assert out.logprobs.grad_fn is None
    assert torch.allclose(out.logprobs[:, 1:], hf_logprobs(path, ids), atol=1e-5, rtol=0)
    hot = token_logprobs(model, ids, temperature=0.5)
    assert not torch.allclose(hot.logprobs, out.logprobs)


def test_with_grad_backpropagates_to_the_weights(moe):
    _, model = moe
    model.zero_grad(set_to_none=True)
    out = token_logprobs(model, random_ids(2, 12), grad=True)
    out.logprobs.sum().backward()
    grad = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_packed_and_left_padded_rows_equal_separate_sequences(moe):
    _, model = moe
    a, b = random_ids(1, 7, seed=1), random_ids(1, 9, seed=2)
    packed = torch.cat([a, b, torch.zeros(1, 4, dtype=torch.long)], 1)
    seg = torch.tensor([[0] * 7 + [1] * 9 + [-1] * 4])
    out = token_logprobs(model, packed, segment_ids=seg)
    alone_a, alone_b = token_logprobs(model, a), token_logprobs(model, b)
    assert torch.allclose(out.logprobs[:, :7], alone_a.logprobs, atol=1e-5, rtol=0)
    assert torch.allclose(out.logprobs[:, 7:16], alone_b.logprobs, atol=1e-5, rtol=0)
    assert out.mask.tolist() == [[False] + [True] * 6 + [False] + [True] * 8 + [False] * 4]

    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)
    mask = torch.tensor([[0] * 5 + [1] * 9])
    left = token_logprobs(model, padded, attention_mask=mask)
    assert torch.allclose(left.logprobs[:, 5:], alone_b.logprobs, atol=1e-5, rtol=0)
    assert (left.logprobs[:, :6] == 0).all()


def test_routed_experts_equal_hf_router_choices(moe):
    path, model = moe
    ids = random_ids(2, 16, seed=3)
    out = token_logprobs(model, ids, return_routed_experts=True)
    ref = hf_routes(path, ids)
    assert out.routed_experts.shape == ref.shape == (2, 2, 16, 2)
    assert torch.equal(out.routed_experts, ref)
    padded = token_logprobs(model, ids, attention_mask=torch.arange(16).expand(2, 16) >= 4,
                            return_routed_experts=True)
    assert (padded.routed_experts[:, :, :4] == -1).all() and (padded.routed_experts[:, :, 4:] >= 0).all()


def test_attention_mask_is_causal_within_segments_and_padding_attends_to_itself():
    m = attention_mask_for(torch.tensor([[0, 0, 1, -1], [-1, -1, 0, 0]]))[:, 0]
    allowed = (~m).int().tolist()
    assert allowed[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    assert allowed[1] == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]  # no real token sees padding


def test_padding_leaves_real_tokens_gradients_unchanged(moe):
    """Gradients of the real tokens' log-probs of a right- and a left-padded row equal those of each
    sequence alone (no padding), so padding queries attending to themselves change nothing real."""
    _, model = moe
    a, b = random_ids(1, 6, seed=4), random_ids(1, 9, seed=5)

    def grads(ids, mask=None):
        model.zero_grad(set_to_none=True)
        token_logprobs(model, ids, attention_mask=mask, grad=True).logprobs.sum().backward()
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    alone_a, alone_b = grads(a), grads(b)
    ids = torch.cat([torch.cat([a, torch.zeros(1, 3, dtype=torch.long)], 1),
                     torch.cat([torch.zeros(1, 0, dtype=torch.long), b], 1)])
    mask = torch.tensor([[1] * 6 + [0] * 3, [1] * 9])
    right = grads(ids, mask)
    left = grads(torch.cat([torch.zeros(1, 3, dtype=torch.long), a], 1), torch.tensor([[0] * 3 + [1] * 6]))
    for name, g in alone_a.items():  # fp32 rounding of sums over other batch shapes, relative to each tensor
        both = g + alone_b[name]
        torch.testing.assert_close(right[name], both, rtol=0, atol=1e-4 * float(both.abs().max()))
        torch.testing.assert_close(left[name], g, rtol=0, atol=1e-4 * float(g.abs().max()))


def test_dense_model_has_no_routes(megatron_ws1):
    model = build_gpt(tiny_checkpoint("qwen3"))
    with pytest.raises(ValueError, match="no MoE router"):
        token_logprobs(model, random_ids(1, 8), return_routed_experts=True)
    with pytest.raises(ValueError, match="not both"):
        token_logprobs(model, random_ids(1, 8), attention_mask=torch.ones(1, 8), segment_ids=torch.zeros(1, 8))
