"""What the trainer runs on the installed software stack: each Megatron fusion on where the stack provides its
kernel, off with the reason where it does not (`fusions`), the gradient norm's kernel (`grad_norm`), and the
routed experts' module (`experts`).

Imports no Megatron: `qurl train --check` prints the same choices that `megatron.gpt.gpt_config`,
`megatron.spec.gpt_spec` and `megatron.sync_free.install` make.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from .recipe import Recipe


@dataclass(frozen=True)
class Stack:
    """The parts of the stack the fusions need: a CUDA device, Transformer Engine, apex's CUDA extensions."""

    cuda: bool
    te: bool
    apex: bool

    @classmethod
    def installed(cls) -> "Stack":
        """This process's stack (apex counts when its CUDA extensions are built, the fused kernels' modules)."""
        have = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731
        return cls(cuda=torch.cuda.is_available(), te=have("transformer_engine"),
                   apex=have("fused_weight_gradient_mlp_cuda") and have("scaled_masked_softmax_cuda"))


@dataclass(frozen=True)
class Fusion:
    """One Megatron fusion: its TransformerConfig field, what it fuses, and the part of the stack with its
    kernel ("cuda": torch's own fuser on a CUDA device)."""

    field: str
    fuses: str
    needs: str


FUSIONS: tuple[Fusion, ...] = (
    Fusion("gradient_accumulation_fusion", "weight-gradient GEMM accumulating into fp32 main_grad (apex's "
           "fused_weight_gradient_mlp_cuda; TE linears have their own)", "apex"),
    Fusion("bias_activation_fusion", "SwiGLU (times the routing probability in experts), torch-fused", "cuda"),
    Fusion("bias_dropout_fusion", "bias + dropout + residual add, torch-fused", "cuda"),
    Fusion("apply_rope_fusion", "rotary embedding (Transformer Engine's fused RoPE)", "te"),
    Fusion("masked_softmax_fusion", "scale + mask + softmax of the local attention (apex's "
           "scaled_masked_softmax_cuda)", "apex"),
    Fusion("persist_layer_norm", "persistent LayerNorm (apex): the spec's norms are torch's RMSNorm", "never"),
)

_MISSING = {"cuda": "no CUDA device", "te": "Transformer Engine is not installed",
            "apex": "apex's CUDA extensions are not installed"}


def fusions(stack: Stack) -> dict[str, tuple[bool, str]]:
    """TransformerConfig field -> (on, why) for every fusion of `FUSIONS` on `stack`. Off on the CPU, whose
    unfused path is the reference the GPU's is checked against."""
    out = {}
    for f in FUSIONS:
        if f.needs == "never":
            out[f.field] = (False, f.fuses)
        elif not stack.cuda:
            out[f.field] = (False, _MISSING["cuda"])
        elif f.needs != "cuda" and not getattr(stack, f.needs):
            out[f.field] = (False, _MISSING[f.needs])
        else:
            out[f.field] = (True, f.fuses)
    return out


#: the gradient norm's kernel, in Megatron's order of preference (`megatron.core.optimizer.clip_grads`): Transformer
#: Engine's, apex's, else ours on the device (`qurl_mcore.megatron.sync_free`), which replaces Megatron's own
#: fallback
GRAD_NORMS = {
    "te": "Transformer Engine's multi_tensor_l2norm",
    "apex": "apex's amp_C.multi_tensor_l2norm",
    "foreach": "torch._foreach_norm on the device (Megatron's own fallback reads every tensor's norm back to the "
               "host)",
}


def grad_norm(stack: Stack) -> tuple[str, str]:
    """(a key of `GRAD_NORMS`, what it is): the kernel that sums the gradient norm's squares on `stack`."""
    name = "te" if stack.te else "apex" if stack.apex else "foreach"
    return name, GRAD_NORMS[name]


#: the modules an MoE layer's routed experts can run as (`megatron.spec.EXPERTS` builds them)
EXPERTS = ("grouped", "sequential")


def experts(recipe: Recipe) -> tuple[str, str]:
    """(a name of `EXPERTS`, why): grouped GEMMs unless the recipe's expert linears cannot run grouped."""
    quantized = "experts" in recipe.train_groups
    if quantized and recipe.te:
        return "sequential", ("Transformer Engine's FP8 linears per expert (its TEGroupedMLP keeps another "
                              "parameter layout, which the HF conversion does not map)")
    spec = recipe.train
    if quantized and not all(g.row_grouped for g in (spec.weight_granularity, spec.act_granularity,
                                                     spec.grad_granularity)):
        return "sequential", (f"per-{spec.act_granularity} scales span an expert's tokens, which one grouped "
                              "pass over every expert's tokens cannot give")
    return "grouped", "one grouped GEMM per projection over all local experts"
