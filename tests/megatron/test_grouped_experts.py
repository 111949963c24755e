"""Grouped experts (megatron/grouped_experts.py) against Megatron's SequentialMLP over the same quantized linears
and weights, on tiny Qwen3-MoE (4 experts, top-2): log-probs, every gradient and the parameters after one Adam
step, at EP 1 (in this process) and EP 2 (two processes over gloo). On the CPU both run the same GEMMs in the
same order per expert, so the bound is 0: bitwise equal."""
import pytest
import torch

from qurl_mcore.megatron.parallel import spawn
from qurl_mcore.stack import experts as experts_module
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.recipe import resolve

from . import workers
from .helpers import random_ids

#: the largest |grouped − sequential| allowed in log-probs, gradients and updated parameters on the CPU
BOUND = 0.0


def _check(result):
    assert result["modules"] == ("GroupedExperts", "SequentialMLP")
    assert result["expert_grad"] > 0  # the experts do get gradients
    for key in ("logprobs", "grads", "params"):
        assert result[key] <= BOUND, (key, result[key])


@pytest.mark.parametrize("name,recipe", workers.grouped_recipes(), ids=[n for n, _ in workers.grouped_recipes()])
def test_grouped_experts_equal_sequential_at_ep1(megatron_ws1, name, recipe):
    _check(workers.grouped_vs_sequential(tiny_checkpoint("qwen3_moe"), random_ids(2, 12, seed=3), recipe))


@pytest.mark.slow
def test_grouped_experts_equal_sequential_at_ep2(megatron_ws1):
    results = spawn(workers.grouped_ep2, 2, tiny_checkpoint("qwen3_moe"), random_ids(2, 12, seed=3))
    for per_rank in results:
        for result in per_rank.values():
            _check(result)


def test_per_tensor_training_keeps_sequential_experts_with_a_reason():
    name, reason = experts_module(resolve("fp8_e2e", "all", "fp8_e4m3", te_available=False))
    assert name == "sequential" and "per-tensor" in reason
    assert experts_module(resolve("fp4_rc"))[0] == experts_module(resolve("bf16"))[0] == "grouped"
