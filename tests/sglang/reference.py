"""An independent reference for the rollout engine: the HF transformers model with every quantized linear
replaced by `qurl_mcore.quant`'s quantized linear under the same spec, in the trainer's (Megatron's) layout:
fused QKV and fused gate/up projections, one weight matrix per expert. Layout matters only for NVFP4,
whose per-tensor scale spans the fused matrix; the other formats scale per row or block."""
from __future__ import annotations

import torch
from torch import nn

from qurl_mcore.precision import quantizes
from qurl_mcore.quant import QuantLinearSpec, quantize_weight, quantized_linear


class _RowsOf(nn.Module):
    """Rows [start, stop) of the output of a quantized fused linear (quantized once, shared by its parts)."""

    def __init__(self, fused: "_FusedQuant", start: int, stop: int):
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop

    def forward(self, x):
        return self.fused(x)[..., self.start:self.stop]


class _FusedQuant(nn.Module):
    def __init__(self, linears: list[nn.Linear], spec: QuantLinearSpec):
        super().__init__()
        self.spec = spec
        self.wq = quantize_weight(torch.cat([m.weight.data for m in linears]), spec)
        biases = [m.bias for m in linears]
        self.bias = None if biases[0] is None else torch.cat([b.data for b in biases])

    def forward(self, x):
        return quantized_linear(x, self.wq, self.bias, self.spec)


def _fuse(parent: nn.Module, names: list[str], spec: QuantLinearSpec) -> None:
    linears = [getattr(parent, n) for n in names]
    fused = _FusedQuant(linears, spec)
    start = 0
    for name, m in zip(names, linears):
        setattr(parent, name, _RowsOf(fused, start, start + m.out_features))
        start += m.out_features


def _quantize_experts(experts: nn.Module, spec: QuantLinearSpec) -> None:
    """HF's Qwen3-MoE expert loop with quantized per-expert GEMMs."""
    w13 = [quantize_weight(w, spec) for w in experts.gate_up_proj.data]
    w2 = [quantize_weight(w, spec) for w in experts.down_proj.data]

    def forward(hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden, dtype=torch.float32)
        for e in range(len(w13)):
            tok, pos = torch.where(top_k_index == e)
            if len(tok) == 0:
                continue
            gate, up = quantized_linear(hidden[tok], w13[e], None, spec).chunk(2, dim=-1)
            y = quantized_linear(experts.act_fn(gate) * up, w2[e], None, spec)
            out.index_add_(0, tok, y.float() * top_k_weights[tok, pos, None].float())
        return out.to(hidden.dtype)

    experts.forward = forward


def reference_model(path, spec: QuantLinearSpec | None, scope: str = "all", dtype=torch.bfloat16):
    """The HF model at `path`, quantized like the rollout engine (spec None: unquantized)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()
    if spec is None:
        return model
    for layer in model.model.layers:
        mlp = layer.mlp
        if quantizes(scope, "attention"):
            _fuse(layer.self_attn, ["q_proj", "k_proj", "v_proj"], spec)
            _fuse(layer.self_attn, ["o_proj"], spec)
        if hasattr(mlp, "gate_proj") and quantizes(scope, "mlp"):  # a dense model's MLP
            _fuse(mlp, ["gate_proj", "up_proj"], spec)
            _fuse(mlp, ["down_proj"], spec)
        if hasattr(mlp, "experts") and quantizes(scope, "experts"):
            _quantize_experts(mlp.experts, spec)
    return model


@torch.no_grad()
def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t = 1..len-1, in fp32."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
