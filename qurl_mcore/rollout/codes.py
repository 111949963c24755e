"""The trainer's half of a code push (`rollout.push: codes`) and of the refit check (`rollout.verify_push`).

`engine_units` reads, from the architecture table, which HF weights an engine quantizes as one tensor (its unit,
`qurl_mcore.quant.wire.Unit`): the weights of one SGLang module in its order, per layer, and per expert for routed
experts, and how an engine of TP > 1 shards it: along rows for column-parallel linears (q/k/v, gate/up), along
columns for row-parallel ones (o_proj, down_proj), over the engine's TP ranks, or for routed experts over its
expert-TP ranks (TP / EP: an engine of EP = TP holds whole experts, each on one rank). `CodePush` turns the
BF16 export stream into the code push's stream, bucket by bucket: every weight of a unit becomes codes and
scales (`quant.wire.encode_unit`, quantized once, with the engine's recipe); everything else stays in full
precision (embeddings, norms, routers, biases, the output layer, linears outside the scope).
It holds a unit's members until the last of them arrives (a unit never spans more than two adjacent buckets in
the trainer's export order). A bucket's codes and scales travel as views of one buffer (`transfer.packed`):
one handle to pass to the engine instead of two or three per weight. It records each unit's digest, which
`compare_digests` checks against the one the engine reports of what it installed.

What stays full precision in a code push of a quantized engine is exactly what the engine does not quantize.
Where code pushes serve (tensor pushes, no MLA attention in scope) is `Config.push_mode`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from qurl_mcore.models.registry import architecture, config_dict, slots
from qurl_mcore.models.slots import config_experts, dense_layers
from qurl_mcore.quant import QTensor, QuantLinearSpec, quantize_weight
from qurl_mcore.quant.wire import (COLUMNS, ROWS, NamedTensor, Unit, digest, encode_unit, has_global_scale,
                                   unit_digest, wire_specs)
from qurl_mcore.transfer import packed


def engine_units(hf_config: Any, groups: frozenset[str], tp: int = 1, ep: int = 1) -> dict[str, Unit]:
    """HF weight name -> its unit (the HF weight names the engine quantizes as one tensor, in its row order, and
    their split over the engine's ranks), for every weight of the linear `groups` an engine of tensor parallelism
    `tp` and expert parallelism `ep` quantizes (`EngineRecipe.groups`)."""
    if tp % ep:
        raise ValueError(f"an engine's expert parallelism ({ep}) must divide its tensor parallelism ({tp}), as "
                         "SGLang requires")
    c = config_dict(hf_config)
    n_dense = dense_layers(architecture(c).config(c))
    units: dict[str, tuple[str, ...]] = {}
    for slot in slots(c):
        if not slot.quantizable or slot.group not in groups:
            continue
        modules = slot.sglang_modules() or tuple((None, (t,)) for t in slot.hf)
        split = COLUMNS if slot.layout == "columns" else ROWS
        shards = tp // ep if slot.per_expert else tp
        for layer in slot.layer_range(c["num_hidden_layers"], n_dense) if slot.per_layer else [None]:
            for expert in range(config_experts(c)) if slot.per_expert else [None]:
                for _, tensors in modules:
                    unit = Unit(tuple(t.format(layer=layer, expert=expert) for t in tensors), split, shards)
                    units.update(dict.fromkeys(unit.names, unit))
    return units


class CodePush:
    """A push's stream transform (module docstring): `spec` is the engine's `QuantLinearSpec`, `units` the
    engine's units (`engine_units`); `send` False keeps the full-precision stream (a BF16 push) and only records
    the digests; `quantizer` is `quantize_weight` or its compiled twin (`rollout.requant`); `verify` False
    records no digests. After the stream is consumed, `digests` maps each unit's first HF weight to its digest."""

    def __init__(self, spec: QuantLinearSpec, units: dict[str, Unit], send: bool = True,
                 quantizer: Callable[[torch.Tensor, QuantLinearSpec], QTensor] = quantize_weight,
                 verify: bool = True):
        self.spec, self.units, self.send, self.quantizer, self.verify = spec, units, send, quantizer, verify
        self.digests: dict[str, str] = {}

    def buckets(self, stream: Iterable[list[NamedTensor]]) -> Iterator[list[NamedTensor]]:
        """The code push's buckets of the export's (or the BF16 buckets themselves, `send` False)."""
        pending: dict[Unit, dict[str, Any]] = {}
        for bucket in stream:
            out: list[NamedTensor] = []
            whole: list[Unit] = []
            for name, w in bucket:
                unit = self.units.get(name)
                if unit is None:
                    out.append((name, w))
                    continue
                held = pending.setdefault(unit, {})
                held[name] = w
                if not self.send:
                    out.append((name, w))
                if len(held) == len(unit.names):
                    whole.append(unit)
            members = [(unit, [(n, held[n]) for n in unit.names]) for unit in whole
                       for held in [pending.pop(unit)]]
            codes: list[NamedTensor] = []
            with _ops_on_one_thread() as threads:
                for unit, (wire, fingerprint) in zip(whole, self._encode(members, threads)):
                    if fingerprint is not None:
                        self.digests[unit.names[0]] = fingerprint
                    if self.send:
                        codes += wire
                out += packed(codes)
            if out:
                yield out
        if pending and self.send:
            yield packed(self._partial(pending))

    def _encode(self, units: list[tuple[Unit, list[NamedTensor]]], threads: int,
                ) -> list[tuple[list[NamedTensor], str | None]]:
        """(wire tensors, digest or None) of each (unit, its members) of a bucket (`encode_unit`), on the host
        side by side on `threads` threads (`_ops_on_one_thread`). The compiled quantizer stays on the calling
        thread: its compilation is not thread-safe."""
        def encode(job: tuple[Unit, list[NamedTensor]]) -> tuple[list[NamedTensor], str | None]:
            unit, members = job
            wire, qs = encode_unit(members, self.spec, self.quantizer, unit.split, unit.shards)
            return wire, unit_digest([digest(q) for q in qs]) if self.verify else None

        on_host = bool(units) and units[0][1][0][1].device.type == "cpu"
        if threads == 1 or not on_host or self.quantizer is not quantize_weight:
            return [encode(job) for job in units]
        with ThreadPoolExecutor(threads, thread_name_prefix="qurl-code-push") as pool:
            return list(pool.map(encode, units))

    def _partial(self, pending: dict[Unit, dict[str, Any]]) -> list[NamedTensor]:
        """The members of units pushed in part (a partial update): their rows alone, which the engine quantizes
        the same way, unless a global scale ties them to the unit's other rows (NVFP4). Not digested: the
        engine's unit holds rows this push did not carry."""
        if has_global_scale(self.spec):
            unit, held = next(iter(pending.items()))
            missing = [n for n in unit.names if n not in held]
            raise ValueError(f"a partial code push of {self.spec.fmt} needs whole units: {missing[0]} is missing "
                             f"beside {next(iter(held))} (their per-tensor scale is one); push the whole unit or "
                             "use rollout.push=bf16")
        out: list[NamedTensor] = []
        for unit, held in pending.items():
            for name, w in held.items():
                out += encode_unit([(name, w)], self.spec, self.quantizer, unit.split, unit.shards)[0]
        return out


@contextlib.contextmanager
def _ops_on_one_thread() -> Iterator[int]:
    """Within: every torch op on the host runs on one thread; yields the threads torch had, for the caller to
    run that many units side by side. Eager quantization is dozens of small passes per unit, and with torch's
    own threads each pass ends on a barrier that waits for the slowest thread, which on a shared machine is
    often descheduled: at load 20 on 2 cores an NVFP4 push's quantization took 5-10x the wall time, and 3-6x
    the CPU time (spinning), that it takes on one thread per unit; so did the copy into the shared buffer
    (`packed`), whose first touch of each page faults."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


def push_specs(shapes: dict[str, list[int]], spec: QuantLinearSpec,
               units: dict[str, Unit]) -> dict[str, tuple[Any, list[int]]]:
    """name -> (dtype, shape) of every tensor a code push may send for a checkpoint of HF tensor `shapes`: the wire
    tensors of each weight in `units`, every other tensor as it is (dtype None: any floating dtype)."""
    out: dict[str, tuple[Any, list[int]]] = {}
    for name, shape in shapes.items():
        unit = units.get(name)
        out.update(wire_specs(name, shape, spec, unit.split, unit.shards) if unit else {name: (None, list(shape))})
    return out


def compare_digests(push: CodePush, installed: dict[str, str]) -> list[str]:
    """What disagrees between a push's digests (`CodePush.digests`) and an engine's report of its installed codes
    (`sglang.weights.installed_digests`), one line per unit: a unit quantized on one side only, or codes that
    differ. Units a partial push did not carry whole are not compared."""
    ours = {unit.names[0] for unit in push.units.values()}
    problems = [f"{n}: quantized by the engine only (the trainer holds it in full precision)"
                for n in sorted(installed.keys() - ours)]
    problems += [f"{n}: quantized by the trainer only (the engine holds it in full precision)"
                 for n in sorted(push.digests.keys() - installed.keys())]
    problems += [f"{n}: the engine's codes differ from the trainer's"
                 for n in sorted(push.digests.keys() & installed.keys()) if push.digests[n] != installed[n]]
    return problems
