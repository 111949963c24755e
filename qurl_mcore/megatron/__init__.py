"""Megatron-Core integration: CPU compatibility, quantized linears through ModuleSpec, HF weights, UAQ, log-probs."""
