"""A trainer rank on fake GPUs (qurl_mcore/fakecuda.py): PolicyTrainer built in bf16 at TP=2, DP=4 (rank 1 of
8 traced; the others exist only in the fake group), stepped through Megatron's DDP with overlap_grad_reduce,
the optimizer and the metrics reduction, as a GPU rank would be."""
from __future__ import annotations

from collections import Counter

import pytest

from qurl_mcore.fakecuda import run_traced

from . import workers

def _syncs_by_file(out: dict) -> Counter:
    """The traced host synchronizations of `workers.trainer_steps`, by the file that asked for them."""
    by_file = Counter()
    for site, n in out["host_sync_sites"].items():
        by_file[site.rsplit(" at ", 1)[1].split(":")[0]] += n
    return by_file


def test_metrics_reduce_on_the_device_over_the_nccl_dp_group():
    """N2: the step's metrics reach NCCL as device tensors, and a dense step's optimizer reads the gradient norm
    once (its kernel reads no tensor's norm back: `megatron.sync_free`) and finalize_model_grads its token count
    once."""
    out = run_traced(workers.trainer_steps, "qwen3", [], [16])
    assert out["policy"] and out["peaks"][1] >= out["peaks"][0] > 0
    by_file = _syncs_by_file(out)
    assert by_file["megatron/core/utils.py"] == 0
    assert by_file["megatron/core/optimizer/clip_grads.py"] == by_file[
        "megatron/core/distributed/finalize_model_grads.py"] == 1


def test_steps_with_different_micro_batch_counts_reduce_every_bucket_once():
    """N1: with overlap_grad_reduce, a step of 2 micro-batches and then one of 1 (dynamic sampling changes the
    count): the gradient reduce starts after the last micro-batch of each step."""
    out = run_traced(workers.trainer_steps, "qwen3", [], [16, 8])
    assert len(out["peaks"]) == 3


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_policy_and_reference_are_on_the_device_in_bf16(arch):
    """N3: torch-built norms and the router come on the CPU in fp32; the KL reference (never in DDP) and the
    policy under the plain bf16 optimizer (distributed optimizer off) have every parameter on the GPU in bf16,
    and a step runs (the MoE's token dispatch copies its split sizes to the host: the façade answers the
    balanced routing)."""
    out = run_traced(workers.trainer_steps, arch, ["train.kl_coef=0.1", "train.distributed_optimizer=false"], [16])
    assert out["policy"] == out["reference"] == [("cuda:0", "torch.bfloat16")] and len(out["peaks"]) == 2


def test_a_push_exports_every_tensor_on_the_device_in_the_rollout_dtype_and_broadcasts_it_over_nccl():
    """The streamed weight push at TP=2 with INT8 rollout and UAQ: each HF tensor
    gathered from its shards on the device, cast to rollout.dtype, and taken by the NCCL-like group (which
    refuses host tensors)."""
    from safetensors import safe_open

    from qurl_mcore.models.tiny import tiny_checkpoint

    out = run_traced(workers.trainer_steps, "qwen3", ["precision=int8", "uaq.enabled=true"], [16], 2, 8, 1, True)
    with safe_open(tiny_checkpoint("qwen3", tokenizer=False) / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert sorted(name for name, *_ in out["pushed"]) == sorted(names)  # each once, none missing
    assert out["policy"] == [("cuda:0", "torch.bfloat16")]  # the rank's one visible GPU, as Ray gives it
    assert {(device, dtype) for _, device, dtype in out["pushed"]} == set(out["policy"])


def test_an_moe_step_under_expert_parallelism_dispatches_balanced_tokens_and_counts_its_host_syncs():
    """EP 4 (TP 1, DP 8): Megatron's all-to-all dispatcher copies the tokens per expert to the host to size its
    all-to-all (the façade answers the balanced routing, which NCCL's split-size rule accepts), and those
    copies' synchronizations are counted where the dispatcher makes them: once per MoE layer and forward (2
    layers, one training forward). Nothing else in the layers reads back (`megatron.sync_free`: the unfused
    permutation, in moe_utils, and the gradient norm's fallback, in megatron/core/utils.py), and the optimizer
    step reads its norm once and finalize_model_grads its token count once."""
    by_file = _syncs_by_file(run_traced(workers.trainer_steps, "qwen3_moe", ["train.ep_size=4"], [16], 1))
    assert by_file["megatron/core/transformer/moe/token_dispatcher.py"] == 2
    assert by_file["megatron/core/utils.py"] == by_file["megatron/core/transformer/moe/moe_utils.py"] == 0
    assert by_file["megatron/core/optimizer/clip_grads.py"] == by_file[
        "megatron/core/distributed/finalize_model_grads.py"] == 1
