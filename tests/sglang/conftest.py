"""Real SGLang engines on CPU for the plugin tests, shared per module (each start costs ~20 s)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from qurl_mcore.models.smollm2 import hf_checkpoint
from qurl_mcore.models.tiny import tiny_checkpoint

PROMPT = "The capital of France is Paris. The capital of Germany is"


def model_path(name: str) -> str:
    return str(hf_checkpoint() if name == "smollm2" else tiny_checkpoint(name))


def prompt_ids(path: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]


@contextlib.contextmanager
def local_engine(path: str, method: str | None, options: dict | None = None, dtype: str = "float32", **kw):
    """A small in-process engine; fp32 activations unless asked otherwise (see test_logprobs.py for why).

    Every request computes all its tokens (no radix cache). The tests send token ids and read ids and log-probs,
    never text, so the engine loads no tokenizer: that saves about 4 s and 8 CPU-s of each start (the loop's
    engines keep theirs: rewards read the completions' text)."""
    from qurl_mcore.rollout import EngineConfig, LocalEngine

    config = EngineConfig(path, method, options or {}, device="cpu", dtype=dtype, mem_fraction_static=0.2,
                          max_total_tokens=4096, context_length=1024,
                          extra={"disable_radix_cache": True, "skip_tokenizer_init": True}, **kw)
    engine = LocalEngine(config)
    try:
        yield engine
    finally:
        engine.shutdown()


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


def score(engine, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log p(ids[t] | ids[:t]), t >= 1, from one prefill of the whole sequence."""
    g = engine.generate([ids], {"max_new_tokens": 1, "temperature": 0.0}, prompt_logprobs=True)[0]
    return torch.tensor(g.prompt_logprobs, dtype=torch.float32)


PROJECTIONS = ("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")


def noisy_layer0(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer 0's projections (Mixtral's experts: w1, w3, w2) moved by 0.2 of their std (seeded): a push the
    engine must re-quantize."""
    gen = torch.Generator().manual_seed(1)
    return {k: (v.float() + 0.2 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
            if k.startswith("model.layers.0.") and k.endswith(PROJECTIONS) else v for k, v in original.items()}


def write_checkpoint(src: str, tensors: dict[str, torch.Tensor], dst) -> str:
    """A copy of checkpoint `src` with its tensors replaced by `tensors` (for the reference model)."""
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield
