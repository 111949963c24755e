"""An HF checkpoint run a decoder layer at a time (qurl_mcore/layerwise.py): the same hidden states and the same
smoothing scales as the whole model, bitwise, while the host holds one layer's weights at a time."""
from __future__ import annotations

import pytest
import torch

from qurl_mcore.layerwise import LayerwiseModel
from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.precision import SCOPES
from qurl_mcore.smoothing import calibrate

#: dense (GQA with q/k/v biases), routed experts in fused tensors, a dense prefix before MoE layers, MLA
ARCHS = ["qwen2", "qwen3_moe", "glm4_moe", "deepseek_v3"]


def _whole(arch: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.float32).eval()


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(10, 5000, (n,), generator=g) for n in (9, 14, 5)]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_prompts_hidden_states_are_the_whole_models_bitwise(arch):
    whole, prompts = _whole(arch), _prompts()
    seen = []  # the last layer's output: what the final norm reads
    whole.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        for ids in prompts:
            whole(ids.reshape(1, -1))
    got = LayerwiseModel(tiny_checkpoint(arch)).run(prompts)
    assert len(got) == len(seen) == len(prompts)
    assert all(torch.equal(a, b) for a, b in zip(got, seen))


@pytest.mark.parametrize("arch", ARCHS)
def test_calibrated_scales_are_the_whole_models_bitwise(arch):
    whole, prompts = _whole(arch), _prompts()
    want = calibrate(whole, prompts, whole.config, SCOPES["all"], alpha=0.5)
    model = LayerwiseModel(tiny_checkpoint(arch))
    got = calibrate(model.module, prompts, model.module.config, SCOPES["all"], alpha=0.5, run=model.run)
    assert want and got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_host_holds_one_layers_weights_at_a_time():
    """The weights the model holds as each decoder layer is called: in the pass that captures the layers'
    arguments (layers as identities), those outside the layers; then, as every prompt passes layer i, those and
    layer i's, never another layer's; after the run, none of the layers'."""
    arch = "deepseek_v3"  # a dense layer, then an MoE one
    whole = _whole(arch)
    per_layer = [_bytes(layer.state_dict().values()) for layer in whole.model.layers]
    model = LayerwiseModel(tiny_checkpoint(arch))
    outside = _bytes(model.module.state_dict().values())
    assert outside == _bytes(whole.state_dict().values()) - sum(per_layer)  # every layer on `meta` until run
    held = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _m, _a: held.append(_bytes(model.module.state_dict().values())))
    prompts = _prompts()
    model.run(prompts)
    capture = [outside] * (len(prompts) * len(per_layer))
    assert held == capture + [outside + n for n in per_layer for _ in prompts]
    assert max(held) < outside + sum(per_layer)  # below the whole model's
    assert _bytes(model.module.state_dict().values()) == outside
