"""The CUDA façade itself (qurl_mcore/fakecuda.py), in a traced process: NCCL's device rule on the default
group, gloo groups that take CPU tensors, device mixes, the bytes alive, and Megatron's groups on it."""
from __future__ import annotations

import pytest

from qurl_mcore.fakecuda import fake_cuda, run_traced

from . import workers


def test_nccl_groups_refuse_cpu_tensors_and_gloo_groups_take_them():
    out = run_traced(workers.collectives)
    assert out["device"] == "cuda:3" and out["y"] == ("cuda:3", "torch.bfloat16")
    assert "on cpu: NCCL takes CUDA tensors only" in out["nccl_cpu"] and "torch.float64" in out["nccl_cpu"]
    assert out["mix"] == "FakeTensorDeviceMismatchError"
    # 1024 fp32 (4096 B) and a bf16 copy of 1022 of them (2044 B): the view costs nothing, the copy does
    assert (out["live"], out["peak"]) == (6140, 6140)
    assert (out["live_after_del"], out["peak_after_del"]) == (2044, 6140)
    assert out["capability"] == (9, 0)


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
