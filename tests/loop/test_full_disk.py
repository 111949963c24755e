"""A disk that fills during a real `torch_dist` save: the trainer (tiny Llama, Megatron's distributed save)
writes its first checkpoint onto a 1 MiB tmpfs mounted for the test in a mount namespace of its own
(`unshare -m`), so every write past the first MiB fails as on a full disk. The run's error names the full disk
and the way out, and the half-written step is gone (tests/test_checkpoint.py checks the parts on their own)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

SAVE = """
import errno, sys
from pathlib import Path
from qurl_mcore.config import load_config
from qurl_mcore.loop.trainer import PolicyTrainer

root = Path(sys.argv[1])
cfg = load_config(None, ["model.path=tiny-llama", "precision=bf16", "uaq.enabled=false",
                         f"checkpoint.dir={root}", "checkpoint.format=torch_dist"])
trainer = PolicyTrainer(cfg, cfg.recipe())
try:
    trainer.save_checkpoint(str(root), 1)
except OSError as err:
    assert err.errno == errno.ENOSPC, err
    print("ERROR", err)
    print("LEFT", sorted(p.name for p in root.iterdir()))
finally:
    trainer.close()
"""


def _can_mount(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow  # a Megatron trainer in a subprocess, about 20 s
def test_a_save_that_fills_a_real_disk_is_named_and_its_partial_removed(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _can_mount(disk):
        pytest.skip("needs a mount namespace (unshare -m) and tmpfs mounts, as the netns tests do")
    done = subprocess.run(["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"',
                           str(disk), sys.executable, "-c", SAVE, str(disk)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("ERROR", "LEFT")))
    assert "no space left on device for" in lines["ERROR"] and "step_00000001" in lines["ERROR"], done.stdout
    assert "its partial files are removed" in lines["ERROR"] and "set checkpoint.dir to another disk" in lines["ERROR"]
    assert lines["LEFT"] == "[]", lines  # nothing of the step is left on the full disk
