"""The planner's activation bytes (`qurl_mcore.sizing`) against what a real Megatron model keeps.

Two instruments, neither part of the planner: torch's saved-tensor hooks (every tensor autograd keeps for the
backward, custom autograd functions included, counted once per storage and never a parameter's), and the
profiler's allocator events (every allocation and free in order, so the peak of live bytes). The models use
SDPA core attention, as on GPUs; fp32 on the CPU, so e = 4.
"""
import pytest
import torch

from qurl_mcore.config import load_config
from qurl_mcore.megatron import build_gpt
from qurl_mcore.megatron.logprobs import token_logprobs
from qurl_mcore.models import resolve_model_path
from qurl_mcore.models.registry import shape
from qurl_mcore.recipe import resolve
from qurl_mcore.sizing import activation_bytes, layer_activation_bytes, model_config
from qurl_mcore.sizing.memory import _stages, rope_bytes


def _plan(name: str, precision: str, s: int, b: int, recompute: str = "none"):
    cfg = load_config(None, [f"model.path={name}", f"precision={precision}", "uaq.enabled=false",
                             f"rollout.context_length={s}", f"train.micro_batch_size={b}",
                             "rollout.max_new_tokens=8", f"train.recompute={recompute}"])
    return shape(model_config(name)[0]), cfg


def _saved_in_layers(model, ids) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while a decoder layer runs its forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    depth, saved = [0], {}
    for name, m in model.named_modules():
        if name.startswith("decoder.layers.") and name.count(".") == 2:
            m.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1))
            m.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1))

    def pack(t):
        storage = t.untyped_storage()
        if depth[0] and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, ids, grad=True)
    return sum(saved.values())


def _peak_live_bytes(fn) -> int:
    """The highest sum of bytes allocated and not yet freed while `fn` runs (the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("precision", ["bf16", "fp4_rc"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3_moe", "tiny-mixtral",
                                  "tiny-qwen2_moe", "tiny-glm4_moe", "tiny-deepseek_v3"])
def test_layer_activations_equal_what_autograd_keeps(megatron_ws1, name, precision):
    """Per layer: GQA attention (+ q/k norms for Qwen3 and GLM-4.5) or MLA, the dense GLU MLP, routed experts
    (+ a shared expert, gated for Qwen2-MoE) as the trainer's grouped experts run them (in full precision their
    stacked weights), dense first layers before MoE ones, and for the quantized-training precision the fp32
    weights and inputs its linears keep."""
    s, b = 64, 2
    shape, cfg = _plan(name, precision, s, b)
    ids = torch.randint(3, 1000, (b, s), generator=torch.Generator().manual_seed(0))
    model = build_gpt(resolve_model_path(name), recipe=resolve(precision), core_attention="sdpa")
    measured = _saved_in_layers(model, ids)
    if "mla" in shape.features:
        # MLA's v is narrower than q and k: torch's CPU SDPA then runs its math path, which keeps the attention
        # probabilities (e·a·s per token) instead of the mask and log-sum-exp a GPU's fused kernel keeps
        measured -= shape.layers * b * s * (4 * shape.heads * s - 4 * s - 4 * shape.heads)
    per = layer_activation_bytes(shape, cfg, e=4)
    rope = rope_bytes(shape, s, e=4)
    stage = _stages(shape, cfg)[0]
    planned = (sum(s * b * (per["attention"] + per["core"] + per[mlp]) + rope for mlp in
                   ["dense_mlp"] * stage.dense_layers + ["mlp"] * (shape.layers - stage.dense_layers))
               + 4 * stage.trained_quantized + 4 * stage.stacked_experts)
    assert planned == pytest.approx(measured, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_peak_of_a_real_step(megatron_ws1, recompute):
    """SmolLM2 (30 layers; at 2 x 256 tokens its layers keep twice what its logits take): the peak of a forward
    and backward over the parameters' preallocated gradients (the trainer's DDP buffer, counted as static)
    within 10% of `activation_bytes` (measured: 0.98-1.03)."""
    s, b = 256, 2
    shape, cfg = _plan("smollm2", "bf16", s, b, recompute)
    model = build_gpt(resolve_model_path("smollm2"), recompute=recompute, core_attention="sdpa")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ids = torch.randint(3, 1000, (b, s), generator=torch.Generator().manual_seed(0))
    peak = _peak_live_bytes(lambda: token_logprobs(model, ids, grad=True).logprobs.sum().backward())
    assert activation_bytes(shape, cfg, recompute, e=4)[0] == pytest.approx(peak, rel=0.10)
