"""An HF checkpoint's causal LM run on the host one decoder layer at a time (`LayerwiseModel`), for passes that
need every layer's inputs but not the whole model in memory (rollout.smoothing's calibration: DeepSeek-V3 in
fp32 is 2.7 TB).

The model is built as transformers builds it (its classes, its attention implementation, its checkpoint
conversions: fused expert tensors), with every parameter on the `meta` device; the tensors outside the decoder
layers (embeddings, norms, head) are read once. `run(prompts)` then takes the prompts through the layers in
layer-major order: layer i's weights are read from the safetensors files, every prompt's hidden state passes
it, and its weights go back to `meta` before layer i+1 is read. Each layer is called with the arguments the
model's own forward gives it (rotary embeddings, masks, positions: captured in one pass with the layers as
identities), so each prompt's hidden states are those of `model(ids)`, bitwise (the same operations on the
same values, in another order over the prompts). Host memory holds the weights outside the layers, one
layer's, and the prompts' hidden states.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


class _Captured(Exception):
    """Ends the capture pass after the last layer: the final norm and head are not needed."""


class LayerwiseModel:
    """The causal LM of HF checkpoint directory `hf_dir` in `dtype`, its decoder layers' weights read one layer
    at a time by `run` (module docstring). `module` is the transformers model: hooks registered on its
    submodules see what they would see in `module(ids)`."""

    def __init__(self, hf_dir: str | Path, dtype: torch.dtype = torch.float32):
        # transformers only where a checkpoint runs on the host (rank 0's calibration)
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping

        files = sorted(Path(hf_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
        self._handles = [safe_open(str(f), "pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}
        with torch.device("meta"):
            self.module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=dtype).eval()
        self.dtype = dtype
        self.layers = self.module.get_decoder().layers
        self._mapping = get_model_conversion_mapping(self.module)
        self._prefix = next(n for n, m in self.module.named_modules() if m is self.layers) + "."
        self._layer_key = re.compile(rf"^{re.escape(self._prefix)}(\d+)\.")
        self._load(lambda name: self._layer_key.match(name) is None)
        self._host_buffers()

    def _load(self, wanted) -> None:
        """Read the checkpoint's tensors whose names `wanted` accepts into the model (transformers' conversions
        and cast to `dtype`, as `from_pretrained` reads them)."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging

        state = {name: h.get_slice(name) for name, h in self._where.items() if wanted(name)}
        shown = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()  # not one bar a layer
        try:
            convert_and_load_state_dict_in_model(self.module, state, LoadStateDictConfig(
                dtype=self.dtype, device_map={"": "cpu"}, weight_mapping=self._mapping))
        finally:
            if shown:
                logging.enable_progress_bar()

    def _host_buffers(self) -> None:
        """The buffers outside the layers that no checkpoint holds (rotary frequencies), made on the host as
        `from_pretrained` makes them (the model's `_init_weights`)."""
        for name, buffer in self.module.named_non_persistent_buffers():
            if buffer.is_meta and not name.startswith(self._prefix):
                owner, _, attr = name.rpartition(".")
                module = self.module.get_submodule(owner)
                setattr(module, attr, torch.empty_like(buffer, device="cpu"))
                self.module._init_weights(module)

    def _layer_weights(self, i: int) -> None:
        """Layer `i`'s weights, read from the checkpoint."""
        self._load(lambda name: (m := self._layer_key.match(name)) is not None and int(m[1]) == i)

    @torch.no_grad()
    def run(self, prompts: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Every prompt (1-D token ids) through the decoder layers, layer by layer (module docstring); the last
        layer's output hidden state of each prompt ([1, tokens, hidden])."""
        calls = [self._layer_calls(ids) for ids in prompts]
        hidden = [c[0][0][0] for c in calls]
        for i, layer in enumerate(self.layers):
            self._layer_weights(i)
            try:
                for p, c in enumerate(calls):
                    args, kwargs = c[i]
                    out = layer(hidden[p], *args[1:], **kwargs)
                    hidden[p] = out[0] if isinstance(out, tuple) else out
            finally:
                layer.to("meta")  # its weights leave the host before the next layer's are read
        return hidden

    def _layer_calls(self, ids: torch.Tensor) -> list[tuple[tuple, dict[str, Any]]]:
        """The (args, kwargs) the model's forward gives each decoder layer for prompt `ids`, from a pass with
        the layers as identities (the first layer's first argument is the embedded prompt)."""
        calls: list[tuple[tuple, dict[str, Any]]] = []
        last = len(self.layers) - 1

        def identity(i):
            def forward(*args, **kwargs):
                calls.append((args, kwargs))
                if i == last:
                    raise _Captured
                return args[0]
            return forward

        for i, layer in enumerate(self.layers):
            layer.forward = identity(i)
        try:
            self.module(ids.reshape(1, -1), use_cache=False)
        except _Captured:
            pass
        finally:
            for layer in self.layers:
                del layer.forward
        return calls
