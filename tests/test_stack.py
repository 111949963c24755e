"""Which Megatron fusions, gradient-norm kernel and experts module the trainer runs, by stack
(`qurl_mcore.stack`), with hand-given stacks, and what `qurl train --check` prints of them."""
from __future__ import annotations

import pytest

from qurl_mcore.cli import main
from qurl_mcore.recipe import resolve
from qurl_mcore.stack import EXPERTS, FUSIONS, GRAD_NORMS, Stack, experts, fusions, grad_norm

ALL = {f.field for f in FUSIONS}


@pytest.mark.parametrize("stack,on", [
    (Stack(cuda=False, te=True, apex=True), set()),  # the CPU runs the unfused reference path
    (Stack(cuda=True, te=False, apex=False), {"bias_activation_fusion", "bias_dropout_fusion"}),
    (Stack(cuda=True, te=True, apex=False), {"bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion"}),
    (Stack(cuda=True, te=False, apex=True), {"bias_activation_fusion", "bias_dropout_fusion",
                                             "gradient_accumulation_fusion", "masked_softmax_fusion"}),
    (Stack(cuda=True, te=True, apex=True), ALL - {"persist_layer_norm"}),
])
def test_each_fusion_is_on_where_the_stack_has_its_kernel_and_off_with_the_reason(stack, on):
    choice = fusions(stack)
    assert set(choice) == ALL
    assert {name for name, (yes, _) in choice.items() if yes} == on
    reasons = {name: why for name, (yes, why) in choice.items() if not yes}
    assert "RMSNorm" in reasons.pop("persist_layer_norm")  # the spec's torch norms: never
    if not stack.cuda:
        assert set(reasons.values()) == {"no CUDA device"}
    else:
        assert ("Transformer Engine is not installed" in reasons.get("apply_rope_fusion", "")) == (not stack.te)
        assert ("apex" in reasons.get("masked_softmax_fusion", "")) == (not stack.apex)


def test_gpt_config_takes_the_installed_stacks_fusions(megatron_ws1):
    from qurl_mcore.megatron.gpt import gpt_config
    from qurl_mcore.models.tiny import tiny_checkpoint

    config = gpt_config(tiny_checkpoint("qwen3_moe"))
    assert {name: getattr(config, name) for name in ALL} == {
        name: on for name, (on, _) in fusions(Stack.installed()).items()}


@pytest.mark.parametrize("stack,kernel", [
    (Stack(cuda=True, te=True, apex=True), "te"),  # Megatron's own order: Transformer Engine's first
    (Stack(cuda=True, te=False, apex=True), "apex"),
    (Stack(cuda=True, te=False, apex=False), "foreach"),
    (Stack(cuda=False, te=False, apex=False), "foreach"),
])
def test_the_grad_norm_kernel_is_the_stacks_else_the_device_side_one(stack, kernel):
    assert grad_norm(stack) == (kernel, GRAD_NORMS[kernel])


def test_experts_are_grouped_unless_a_scale_spans_an_experts_tokens():
    assert EXPERTS == ("grouped", "sequential")
    for precision in ("bf16", "int8", "fp4", "fp4_rc", "fp4_rc_rollout", "fp4_rc_train"):
        assert experts(resolve(precision))[0] == "grouped", precision
    name, why = experts(resolve("fp8_e2e", te_available=False))
    assert name == "sequential" and "per-tensor" in why
    name, why = experts(resolve("fp8_e2e", te_available=True))
    assert name == "sequential" and "Transformer Engine" in why


def test_train_check_prints_the_fusions_the_grad_norm_and_the_experts_module(tmp_path, capsys):
    args = ["train", "--check", "model.path=tiny-qwen3_moe", "uaq.enabled=false", "precision=fp4_rc",
            f"logging.dir={tmp_path}/logs", f"checkpoint.dir={tmp_path}/c"]
    assert main(args) == 0
    out = capsys.readouterr().out
    choice = fusions(Stack.installed())
    on = [name for name, (yes, _) in choice.items() if yes]
    assert f"fusions     {', '.join(on) or 'none'} on" in out
    for name, (yes, why) in choice.items():
        assert (f"{name} off: {why}" in out) == (not yes)
    assert "experts     grouped: one grouped GEMM per projection" in out
    assert "grad norm   {}: {}".format(*grad_norm(Stack.installed())) in out
