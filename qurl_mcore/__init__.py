"""qurl-mcore: quantized-rollout RL for Megatron-Core (training) and SGLang (rollout)."""

__version__ = "0.1.0"
