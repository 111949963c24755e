"""Run megatron-core 0.16.1 on a machine without CUDA (CI, laptops): small runtime fixes, one per assumption.

Megatron-Core assumes a GPU in a handful of places even when every tensor lives on the CPU. Each fix below
replaces one such assumption with its CPU meaning; none changes any numerics. `apply_cpu_compat()` applies
them, before or after megatron is imported (every fix patches the attribute that megatron reads at call
time): all of them when `torch.cuda.is_available()` is False, and on a GPU only the ones that are bugs of
megatron-core rather than CPU adaptations (`GPU_FIXES`: te_general_gemm, which an MoE without Transformer
Engine needs on any device). `revert_cpu_compat()` puts back every attribute they replaced
(`parallel.destroy_parallel` calls it: the fixes live as long as Megatron's process groups).

The fixes are scoped to megatron: they replace attributes of megatron's own modules and classes, never of torch.
Where megatron calls `torch.cuda` (current_device, streams, synchronize, the generator), its modules read a
`torch` of their own (`_TorchOnCpu`); `torch` and `torch.cuda` themselves stay torch's for every other caller in
the process (SGLang, user code).

With them Megatron's own training stack runs on the CPU: `DistributedDataParallel`, `finalize_model_grads`,
the schedules' `get_forward_backward_func` and `get_megatron_optimizer` (fp32). Not on the CPU: the
distributed optimizer and Megatron's mixed-precision (bf16) optimizer, which check for CUDA tensor types
(`qurl train --check` refuses them there).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import types
from typing import Callable

import torch

_APPLIED: list[str] = []
#: what undoes each change the fixes made, in the order they made them
_UNDO: list[Callable[[], None]] = []


def _replace(owner: object, name: str, value: object) -> None:
    """`owner.name = value` (a module's or a class's own attribute), undone by `revert_cpu_compat`."""
    if name in vars(owner):
        _UNDO.append(functools.partial(setattr, owner, name, vars(owner)[name]))
    else:
        _UNDO.append(functools.partial(delattr, owner, name))
    setattr(owner, name, value)


@contextlib.contextmanager
def _cpu_generator_seeded(seed: int):
    """For the duration, the CPU generator seeded by `seed`; then it is as it was."""
    before = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(before)


def _rng_tracker() -> None:
    """The "CUDA" RNG of megatron's RNG tracker is the CPU generator. The tracker is needed even without
    dropout (DotProductAttention always forks it), and it seeds and saves CUDA generator states: a tracked
    state is the CPU generator seeded by the state's seed, made without moving the CPU generator itself
    (the "CUDA" generator a megatron module sees is the CPU one, which its `torch.cuda.manual_seed` leaves alone,
    as CPU torch's own lazy no-op would: `model_parallel_cuda_manual_seed` does not move the CPU generator)."""
    # the module a fix patches, imported only when the fix applies (a GPU applies GPU_FIXES alone)
    import megatron.core.tensor_parallel.random as mrandom

    _replace(mrandom, "_get_cuda_rng_state",
             lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    _replace(mrandom, "_set_cuda_rng_state",
             lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    add = mrandom.CudaRNGStatesTracker.add

    @functools.wraps(add)
    def add_on_cpu(self, name, seed):
        with _cpu_generator_seeded(seed):
            add(self, name, seed)

    _replace(mrandom.CudaRNGStatesTracker, "add", add_on_cpu)
    # fork() warns whenever the CPU generator advanced inside a "GPU" RNG context: now it always does.
    logger = logging.getLogger(mrandom.__name__)
    _UNDO.append(functools.partial(logger.setLevel, logger.level))
    logger.setLevel(logging.ERROR)


def _te_general_gemm() -> None:
    """moe_utils.te_general_gemm = None. megatron-core 0.16.x defines that name only when Transformer Engine
    imports, yet the router's gating linear reads it unconditionally (NameError without TE)."""
    # the module a fix patches, imported only when the fix applies
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _replace(moe_utils, "te_general_gemm", None)


def _mla_without_te() -> None:
    """multi_latent_attention.HAVE_TE = False where Transformer Engine is absent. megatron-core 0.16.x imports its
    TE extension even then (its TE names are placeholders, not classes), and MLA's constructor then runs
    isinstance(linear_proj, TELinear), a TypeError on any device."""
    # the module a fix patches, imported only when the fix applies
    import megatron.core.transformer.multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        _replace(mla, "HAVE_TE", False)


class _NoopEvent:
    def synchronize(self) -> None: ...

    def wait(self, *args, **kwargs) -> None: ...

    def query(self) -> bool:
        return True


class _NoopStream:
    def wait_stream(self, *args, **kwargs) -> None: ...

    def wait_event(self, *args, **kwargs) -> None: ...

    def record_event(self, *args, **kwargs) -> _NoopEvent:
        return _NoopEvent()

    def synchronize(self) -> None: ...


#: the one side stream of megatron's `torch.cuda` on the CPU: waiting on it or for it returns at once
_NOOP_STREAM = _NoopStream()


def _dispatcher_stream() -> None:
    """The alltoall token dispatcher's shared side stream, made on first use with `torch.cuda.Stream()` (which
    CPU torch cannot make), preset to the no-op stream megatron's `torch.cuda` gives (`_CudaOnCpu`)."""
    # the module a fix patches, imported only when the fix applies
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    _replace(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _NOOP_STREAM)


def _split_sizes_as_numpy() -> None:
    """maybe_move_tensor_to_cpu(t, as_numpy=True) also converts CPU tensors. The alltoall dispatcher (EP > 1)
    relies on it to turn split sizes into numpy for all_to_all_single, but it converts only CUDA tensors;
    a CPU tensor as split sizes makes torch.distributed raise TypeError."""
    # the modules a fix patches, imported only when the fix applies
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _replace(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    _replace(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _causal_masks() -> None:
    """Default causal and sliding-window masks built on the CPU. With attention_mask=None the torch softmax
    path builds them with device="cuda"."""
    # the modules a fix patches, imported only when the fix applies
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    @functools.lru_cache(maxsize=32)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def get_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
        upper = torch.triu(torch.ones(sq, skv, dtype=torch.bool), diagonal=skv - sq - window_size[0])
        return ~torch.tril(upper, diagonal=skv - sq + window_size[1])

    for module in (transformer_utils, fused_softmax):
        _replace(module, "get_default_causal_mask", get_default_causal_mask)
        _replace(module, "get_sliding_window_causal_mask", get_sliding_window_causal_mask)


class _CudaOnCpu:
    """The `torch.cuda` a megatron module sees without CUDA: the real one, except for what megatron calls on
    the CPU path, each given its CPU meaning. current_device() is the CPU (megatron passes
    `device=torch.cuda.current_device()` in ~40 places); streams and synchronize do nothing (the alltoall
    dispatcher copies split sizes on a side stream and waits for its events, pipeline p2p synchronizes after
    its sends: on the CPU there is nothing to overlap or wait for); the generator is the CPU one, and seeding it
    leaves it alone, as CPU torch's lazy `torch.cuda.manual_seed` does."""

    def __init__(self, real):
        self._real = real
        self.current_device = lambda: torch.device("cpu")
        self.current_stream = lambda *args, **kwargs: _NOOP_STREAM
        self.stream = lambda *args, **kwargs: contextlib.nullcontext()
        self.synchronize = lambda *args, **kwargs: None
        self.get_rng_state = lambda device="cuda": torch.get_rng_state()
        self.manual_seed = lambda seed: None

    def __getattr__(self, name: str):
        return getattr(self._real, name)


class _TorchOnCpu:
    """The `torch` a megatron module sees without CUDA: the real one, except that its factory functions put what
    they allocate with device="cuda" (or cuda:N) on the CPU (schedules' token counts, grad norm and clipping, the
    fp32 optimizer and the DDP buffers allocate so in about a dozen places), and its `cuda` is `_CudaOnCpu`."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "zeros_like", "ones_like", "empty_like", "full_like",
                  "arange")

    def __init__(self, real):
        self._real = real
        self.cuda = _CudaOnCpu(real.cuda)
        for name in self._FACTORIES:
            setattr(self, name, self._on_cpu(getattr(real, name)))

    @staticmethod
    def _on_cpu(factory):
        @functools.wraps(factory)
        def on_cpu(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return on_cpu

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def _sees_torch_on_cpu(module: types.ModuleType, torch_on_cpu: _TorchOnCpu) -> None:
    if module.__name__.startswith("megatron.") and vars(module).get("torch") is torch:
        _replace(module, "torch", torch_on_cpu)


class _MegatronImports(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Gives each megatron module imported while the fixes are applied the same `torch` as those imported
    before: megatron imports some of its modules only when first needed (a checkpoint format, a dispatcher).
    Its loader runs the module's own loader and then leaves nothing of itself on the module."""

    def __init__(self, torch_on_cpu: _TorchOnCpu):
        self._torch_on_cpu = torch_on_cpu
        self._loaders: dict[str, importlib.abc.Loader] = {}

    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and isinstance(spec.loader, importlib.abc.Loader):
            self._loaders[name], spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module):
        loader = module.__spec__.loader = module.__loader__ = self._loaders.pop(module.__name__)
        loader.exec_module(module)
        _sees_torch_on_cpu(module, self._torch_on_cpu)


def _torch_on_cpu() -> None:
    """Every megatron module, imported now or later, reads `_TorchOnCpu` as its `torch`; torch itself is
    untouched. Attribute reads it passes through cost one Python call each (well under 1% of a CPU step)."""
    torch_on_cpu = _TorchOnCpu(torch)
    for module in list(sys.modules.values()):
        if isinstance(module, types.ModuleType):
            _sees_torch_on_cpu(module, torch_on_cpu)
    finder = _MegatronImports(torch_on_cpu)
    sys.meta_path.insert(0, finder)
    _UNDO.append(functools.partial(sys.meta_path.remove, finder))


def _clip_grads() -> None:
    """clip_grad_by_total_norm_fp32 asserts grads of type torch.cuda.FloatTensor (the only other CUDA-type
    check on the fp32 path); the same scaling, g *= max_norm / (total_norm + 1e-6) when below 1, without it."""
    # the modules a fix patches, imported only when the fix applies
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0:
            for p in parameters:
                g = p.decoupled_grad if use_decoupled_grad else p.grad
                if g is not None:
                    g.detach().mul_(coeff)

    _replace(clip_grads, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)
    _replace(optimizer, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)


#: (name, fix) in the order they are applied; docs/megatron.md describes each.
FIXES = (
    ("torch_on_cpu", _torch_on_cpu),
    ("rng_tracker", _rng_tracker),
    ("te_general_gemm", _te_general_gemm),
    ("mla_without_te", _mla_without_te),
    ("dispatcher_stream", _dispatcher_stream),
    ("split_sizes_as_numpy", _split_sizes_as_numpy),
    ("causal_masks", _causal_masks),
    ("clip_grads", _clip_grads),
)
#: the fixes that are megatron-core bugs on any device, applied on GPUs too
GPU_FIXES = ("te_general_gemm", "mla_without_te")


def apply_cpu_compat() -> tuple[str, ...]:
    """Apply the fixes this process needs, once until `revert_cpu_compat`: all of them without CUDA,
    `GPU_FIXES` with it. Returns the names of the fixes active in this process."""
    if not _APPLIED:
        cuda = torch.cuda.is_available()
        for name, fix in FIXES:
            if not cuda or name in GPU_FIXES:
                fix()
                _APPLIED.append(name)
    return tuple(_APPLIED)


def revert_cpu_compat() -> None:
    """Put back every attribute the fixes replaced, newest first; the next `apply_cpu_compat` applies them
    again."""
    while _UNDO:
        _UNDO.pop()()
    _APPLIED.clear()
