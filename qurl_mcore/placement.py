"""Where the loop's actors go: the Ray placement-group bundles of a config, and whether a cluster can hold them
(`qurl train --check`, `qurl plan`, and the loop when it starts its actors, `loop/actors.py`).

Layouts (placement groups, strategy PACK so a group fills nodes in order):
  colocated       one bundle per trainer rank ({GPU: 1} on GPUs); trainer rank i and engine host i share
                  bundle i, each with half a device: engines sleep while the trainer steps and vice versa,
                  and with rollout.offload they give back their GPU memory meanwhile (driver.Loop). Engines
                  have TP = 1 here (one per trainer rank). Weights go to the engines as tensors.
  disaggregated   trainer bundles as above on `qurl_train` nodes, plus one bundle of rollout.tp_size devices
                  per engine on `qurl_rollout` nodes. Weights go to the engines by broadcast (driver.Loop).
Nodes started by `launch/ray_cluster.sh` / the Slurm job carry the custom resources `qurl_train` and
`qurl_rollout`; bundles ask for a sliver of them so they land on the right nodes. A cluster without these
tags (e.g. a plain `ray start`) places bundles anywhere. On CPU, a bundle is one CPU.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from qurl_mcore.config import Config

_SLIVER = 0.001  # of a node tag: any number of bundles fit on a tagged node


@dataclass
class Placement:
    """Bundles and who goes where: `trainer[i]`/`engines[j]` are bundle indices, `share` the device (or CPU)
    fraction each actor takes inside its bundle."""

    bundles: list[dict[str, float]]
    trainer: list[int]
    engines: list[int]
    share: float
    device: str  # "GPU" or "CPU"


def placement_of(cfg: Config, use_gpu: bool, tags: set[str] = frozenset()) -> Placement:
    """The placement of `cfg` on a cluster with (`use_gpu`) or without GPUs; `tags` are the node resources
    present (`qurl_train`, `qurl_rollout`)."""
    world = cfg.train.world_size
    device = "GPU" if use_gpu else "CPU"

    def bundle(devices: int, tag: str) -> dict[str, float]:
        out = {device: float(devices)}
        if use_gpu:
            out["CPU"] = 1.0
        if tag in tags:
            out[tag] = _SLIVER
        return out

    if cfg.layout == "colocated":
        if use_gpu and cfg.rollout.tp_size != 1:
            raise ValueError("colocated layout: engines share one device with one trainer rank, so rollout.tp_size "
                             "must be 1 (use layout=disaggregated for multi-device engines)")
        if cfg.rollout.engines > world:
            raise ValueError(f"colocated layout: rollout.engines={cfg.rollout.engines} exceeds the {world} trainer "
                             "bundles it can share; lower it or use layout=disaggregated")
        bundles = [bundle(1, "qurl_train") | ({"qurl_rollout": _SLIVER} if "qurl_rollout" in tags else {})
                   for _ in range(world)]
        return Placement(bundles, list(range(world)), list(range(cfg.rollout.engines)), 0.5, device)
    bundles = [bundle(1, "qurl_train") for _ in range(world)]
    bundles += [bundle(cfg.rollout.tp_size if use_gpu else 1, "qurl_rollout") for _ in range(cfg.rollout.engines)]
    return Placement(bundles, list(range(world)), list(range(world, world + cfg.rollout.engines)), 1.0, device)


def unplaceable(placement: Placement, present: dict[str, float], where: str) -> str | None:
    """Why `placement`'s bundles cannot all be placed on resources `present` (totals), or None."""
    needed: collections.Counter = collections.Counter()
    for bundle in placement.bundles:
        needed.update({k: v for k, v in bundle.items() if k in ("CPU", "GPU")})
    short = {k: (v, present.get(k, 0.0)) for k, v in needed.items() if v > present.get(k, 0.0)}
    if not short:
        return None
    what = ", ".join(f"{need:g} {k} (has {have:g})" for k, (need, have) in short.items())
    return (f"placement: {len(placement.bundles)} bundle(s) need {what} on {where}; lower train.dp_size / "
            "train.tp_size / train.pp_size / rollout.engines, or run on a larger cluster")
