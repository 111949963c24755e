"""The CUDA façade itself (qurl_mcore/fakecuda.py), in a traced process: NCCL's device rule on the default
group, gloo groups that take CPU tensors, device mixes, the bytes alive, and Megatron's groups on it."""
from __future__ import annotations

import pytest

from qurl_mcore.fakecuda import fake_cuda, run_traced

from . import workers


def test_nccl_groups_refuse_cpu_tensors_and_gloo_groups_take_them():
    out = run_traced(workers.collectives)
    assert out["device"] == "cuda:3" and out["y"] == ("cuda:3", "torch.bfloat16")
    assert "on cpu: NCCL takes tensors on the rank's own device (cuda:3" in out["nccl_cpu"]
    assert "torch.float64" in out["nccl_cpu"]
    assert out["mix"] == "FakeTensorDeviceMismatchError"
    # 1024 fp32 (4096 B) and a bf16 copy of 1022 of them (2044 B): the view costs nothing, the copy does
    assert (out["live"], out["peak"]) == (6140, 6140)
    assert (out["live_after_del"], out["peak_after_del"]) == (2044, 6140)
    assert out["capability"] == (9, 0)


def test_nccl_groups_apply_nccls_device_dtype_and_size_rules():
    """What ProcessGroupNCCL on a GPU rank refuses, refused here, and nothing else: a tensor on another rank's
    device, a dtype NCCL does not move (int16) or reduce (float8; bool under AVG; any dtype under a bitwise
    op), and sizes that break a collective's contract."""
    out = run_traced(workers.nccl_rules)
    assert set(out) == set(workers.NCCL_CASES)
    for case, error in out.items():
        assert (error is None) == case.startswith("ok_"), (case, error)
    assert out["other_device"].startswith("NcclDeviceError") and "on cuda:1" in out["other_device"]
    assert "torch.int16" in out["int16"] and "reduces no float8" in out["fp8_all_reduce"]
    assert "ReduceOp.AVG" in out["bool_avg"] and "ReduceOp.BAND" in out["int_band"]
    assert "4 (the group's size) times the part" in out["all_gather_size"]
    assert "torch.bfloat16" in out["all_gather_dtype"] and "times the part" in out["reduce_scatter_size"]
    assert "[2, 1, 1, 2]" in out["all_to_all_splits"] and "divide by the group's size 4" in out["all_to_all_even"]


def test_collectives_whose_shapes_differ_between_traced_ranks_are_found():
    """Ranks traced one by one: an all-reduce of different shapes on two ranks (NCCL would reduce garbage or
    hang) and an all-to-all whose sender and receiver disagree on the rows are named; agreeing ranks pass."""
    agree, found = run_traced(workers.ranks_collectives, [([4, 4], [[1, 2], [3, 4]], None),
                                                          ([4, 5], [[1, 2], [3, 4]], [4, 4])])
    assert agree == []
    assert len(found) == 2
    assert found[0].startswith("group [0, 1], collective 0: rank 0 allreduce_ (((4, 8), 'torch.float32'),)")
    assert found[1] == "group [0, 1], all-to-all 1: rank 0 sends 2 rows to rank 1, which expects 4"


def test_host_reads_answer_from_the_value_model_and_count_as_host_syncs():
    """A read of a value with no data answers what the model knows (finiteness checks pass, a mask selects
    everything, an unknown number is 1; a top-2 of 8 experts routes 12 tokens evenly: 3 a expert) and each
    device-to-host synchronization counts once; a non-blocking copy does not, host data is real."""
    out = run_traced(workers.host_reads)
    assert (out["item"], out["finite"], out["selected"]) == (1.0, True, 8)
    assert out["per_expert"] == [3] * 8 and out["per_token"] == [2] * 12 and out["routed"] == 24
    assert out["masked_select"] == 24 and out["nonzero"] == (24, 2) and out["zeros_any"] is False
    assert out["host_is_real"] and out["host_syncs"] == 11
    assert sum(out["sites"].values()) == 11 and "torch.cuda.synchronize at tests/gpu_trace/workers.py:" in \
        " ".join(out["sites"])


def test_a_host_master_of_a_fake_tensor_stays_without_values():
    """The plugin's pinned host master of a fake CUDA weight is a fake host tensor: the copy costs no host memory
    (a 32 MiB weight grows the process's peak resident memory by less than a quarter of its bytes; materialized,
    its values cost several times them) and counts one host synchronization; a read of a host copy answers
    the device tensor's values (zeros)."""
    numel = 16 << 20  # bf16: 32 MiB
    out = run_traced(workers.host_master, numel)
    assert out["fake"] and out["device"] == "cpu" and out["zeros_any"] is False
    assert out["cuda_bytes"] == 0 and out["host_syncs"] == 1
    assert out["rss_growth_kib"] < numel * 2 / 4 / 1024


def test_megatron_model_parallel_groups_start_on_the_fake_group():
    assert run_traced(workers.model_parallel, 2, 8, 5) == dict(tp=2, dp=4, tp_rank=1, dp_rank=2)


def test_sglang_takes_the_cuda_branches_of_the_traced_gpu():
    """SGLang's `is_cuda()` reads torch.version.cuda (None on a CPU build) and its capability probes SM and
    CUDA version (cached once per process): inside the façade they answer as on the GPU, each context for its
    own GPU, and as on the CPU again after it."""
    sms = {"H100-80GB": 90, "B200": 100, "H200": 90}
    for gpu, out in run_traced(workers.platforms, list(sms)).items():
        sm, inside = sms[gpu], out["inside"]
        assert inside["cuda"] is not None and inside["is_cuda"], gpu
        assert inside["capability"] == (sm // 10, 0) and inside["major"] == sm // 10 and inside["sm"] == sm
        assert (inside["sm90"], inside["hopper"]) == (sm == 90, sm == 90), gpu
        assert (inside["sm100"], inside["blackwell"]) == (sm == 100, sm == 100), gpu
        assert out["after"] == dict(cuda=None, is_cuda=False), gpu


def test_the_facade_refuses_a_process_without_its_runtime():
    with pytest.raises(RuntimeError, match="run_traced"):
        with fake_cuda():
            pass


def test_sglang_would_fuse_the_shared_expert_on_an_h100_and_a_quantized_engine_does_not():
    """On CUDA with SM >= 80 and EP 1, SGLang fuses a shared expert into the routed experts' FusedMoE (E+1
    experts, top-k+1). On a fake H100 a BF16 engine gets that fusion from SGLang's own decision, for GLM-4.5 and
    DeepSeek-V3; a quantized engine keeps the shared expert as its own linears, as the trainer, the precision
    table and the symmetry check hold it (GLM's gate never asks the quant config: the engine's server argument
    turns it off)."""
    from qurl_mcore.models.tiny import tiny_checkpoint

    # DeepSeek's gate fuses only at DeepSeek-V3's own count of routed experts (it reads the config, builds nothing)
    paths = {"glm4_moe": (str(tiny_checkpoint("glm4_moe")), {}),
             "deepseek_v3": (str(tiny_checkpoint("deepseek_v3")), {"n_routed_experts": 256, "n_shared_experts": 1})}
    out = run_traced(workers.shared_expert_fusion, "H100-80GB", paths)
    for model in paths:
        disabled, fused = out[model]["bf16"]
        assert not disabled and fused >= 1, (model, out[model])
        assert out[model]["qurl_fp4_rc"] == (True, 0), (model, out[model])


def test_a_recomputed_attention_runs_as_the_memory_efficient_kernel():
    """Under full recompute the backward runs each layer's forward again on autograd's device thread; there too
    a masked SDPA on a fake GPU runs as the memory-efficient kernel a GPU runs (O(s) bytes), not torch's math
    path, whose [b, heads, s, s] fp32 scores a CPU build would otherwise count (GLM-4.5-Air's traced step: 53 GB
    of them at 9216 tokens)."""
    short, long = run_traced(workers.checkpointed_attention_peaks, [1024, 2048])
    assert 1.8 * short < long < 2.2 * short  # linear in s (the math path: about 4×)
