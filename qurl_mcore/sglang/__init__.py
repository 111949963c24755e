"""SGLang quantization plugin: `qurl_int8`, `qurl_fp8`, `qurl_fp4`, `qurl_fp4_rc` (see options.py).

Registered through the entry point group `sglang.srt.plugins` (setup.py), which SGLang loads in every one of
its processes. Checkpoints load as BF16 and are quantized by `qurl_mcore.quant` after loading (routed experts as
they load) and after every weight update, so the rollout engine runs the trainer's numerics; docs/rollout.md has
the user guide.
"""
from __future__ import annotations

from .options import METHODS, QurlOptions

__all__ = ["METHODS", "QurlOptions", "register"]


def register() -> None:
    """Add the qurl methods to SGLang's registries and its `--quantization` choices, build a Mixtral as its
    FusedMoE class (architecture.py), complete the CPU engine (cpu.py), give an SGLang without weight-update
    sessions one per update call (session.py), keep host masters out of SGLang's device staging (weights.py),
    and bind the process's rendezvous stores to their address (transfer.py). Idempotent."""
    # SGLang only when it loads the plugin: the client imports .options without SGLang
    from sglang.srt.layers import quantization as q
    from sglang.srt.server_args import QUANTIZATION_CHOICES  # where 0.5.15 (slime's image) and 0.5.23 both have it

    from qurl_mcore.transfer import bind_stores_to_their_address

    # these import SGLang: only once SGLang loads the plugin (the client imports .options alone)
    from . import architecture, cpu, session, weights
    from .quant_config import CONFIGS

    architecture.register()  # a qurl Mixtral is SGLang's FusedMoE class, whose routing is captured
    cpu.register()
    session.register()  # an SGLang without weight-update sessions (0.5.15): each update call becomes one
    weights.register()  # host masters stay on the host through SGLang's device_loading_context
    bind_stores_to_their_address()  # the scheduler's rendezvous store listens on 127.0.0.1, not everywhere

    for method, cls in CONFIGS.items():
        # CPU_QUANTIZATION_METHODS is consulted instead of the others on AMX CPUs.
        for registry in (q.QUANTIZATION_METHODS, q.BASE_QUANTIZATION_METHODS, q.CPU_QUANTIZATION_METHODS):
            registry[method] = cls
        if method not in QUANTIZATION_CHOICES:
            QUANTIZATION_CHOICES.append(method)
