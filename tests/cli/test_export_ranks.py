"""`qurl export` of a run with more ranks than the machine has GPUs: every rank is rebuilt on the CPU with gloo,
never bound to a GPU (with NCCL two ranks on one GPU fail: duplicate GPUs)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qurl_mcore.checkpoint import finalize, rank_file, write_file
from qurl_mcore.config import load_config, to_dict
from qurl_mcore.megatron.convert import read_hf_state
from qurl_mcore.models.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]

#: a machine with one GPU, as torch in the export's processes sees it: each process that may see GPUs (not told
#: CUDA_VISIBLE_DEVICES="") is answered one device by torch.cuda, and binding it raises as on this CPU build
ONE_GPU = """
import os
if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
"""


@pytest.mark.slow  # the export's two processes import Megatron: ~1 min on 2 busy cores
def test_a_two_rank_checkpoint_exports_on_a_machine_with_one_gpu(tmp_path, megatron_ws1):
    """A run of two data-parallel ranks (each rank's file holds the whole tiny model) exported where torch sees
    one GPU: the export's ranks see none and run on gloo, and the checkpoint comes back as it went in."""
    from qurl_mcore.megatron import build_gpt, load_hf_weights

    path = str(tiny_checkpoint("llama"))
    cfg = load_config(None, [f"model.path={path}", "train.dp_size=2", "precision=bf16", "uaq.enabled=false"])
    model = build_gpt(path)
    load_hf_weights(model, path)
    files = [write_file(tmp_path / "ckpt", 1, rank_file(r), {"model": model.state_dict()}) for r in range(2)]
    step = finalize(tmp_path / "ckpt", 1, files, {"format": "torch", "world_size": 2, "config": to_dict(cfg)})
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(ONE_GPU)
    out = tmp_path / "hf"
    code = f"from qurl_mcore.export import export_checkpoint; export_checkpoint({str(step)!r}, {str(out)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                               "PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}"})
    assert done.returncode == 0, done.stderr[-3000:]
    exported, original = read_hf_state(out), read_hf_state(path)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
