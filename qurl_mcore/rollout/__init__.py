"""Rollout client for SGLang: start or attach an engine, generate with behaviour log-probs (and routed
experts for MoE), push trainer weights in bounded buckets under a weight version. docs/rollout.md."""
from .engine_config import EngineConfig
from .engine import (
    DEFAULT_BUCKET_BYTES, MEMORY_TAGS, LocalEngine, RolloutEngine, WeightPushError, WeightSpecError,
)
from .http import HttpEngine
from .results import Generation

__all__ = ["DEFAULT_BUCKET_BYTES", "MEMORY_TAGS", "EngineConfig", "Generation", "HttpEngine", "LocalEngine",
           "RolloutEngine", "WeightPushError", "WeightSpecError"]
