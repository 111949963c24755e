"""The QuRL training loop: SGLang rollout with a quantized actor, Megatron training, weights back each step."""
