"""Atomic checkpoints and RNG capture."""
import random

import numpy as np
import pytest
import torch

from qurl_mcore.checkpoint import (
    finalize, latest_checkpoint, latest_valid, list_checkpoints, read_file, read_meta, rng_state,
    set_rng_state, tensor_mismatch, verify, write_file,
)


def _save(root, step, ranks=2, keep=2):
    files = [write_file(root, step, f"rank{r}.pt", {"w": torch.full((3,), float(step + r)), "pos": step * 8})
             for r in range(ranks)]
    return finalize(root, step, files, {"world_size": ranks, "config": {"lr": 1e-6}}, keep=keep)


def test_publish_read_and_keep_newest(tmp_path):
    for step in (5, 10, 15):
        _save(tmp_path, step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000010", "step_00000015"]
    path = latest_checkpoint(tmp_path)
    meta, state = read_meta(path), read_file(path, "rank1.pt")
    assert meta["step"] == 15 and meta["world_size"] == 2 and meta["config"] == {"lr": 1e-6}
    assert [f["file"] for f in meta["files"]] == ["rank0.pt", "rank1.pt"] and verify(path) is None
    assert torch.equal(state["w"], torch.full((3,), 16.0)) and state["pos"] == 120


def test_a_crash_before_publishing_leaves_the_previous_checkpoint(tmp_path):
    _save(tmp_path, 1, ranks=1)
    write_file(tmp_path, 2, "rank0.pt", {"x": 2})  # crash here: step 2 never finalized
    assert latest_checkpoint(tmp_path).name == "step_00000001"
    with pytest.raises(RuntimeError, match=r"lacks \['rank1.pt'\]"):
        finalize(tmp_path, 2, [{"file": "rank0.pt"}, {"file": "rank1.pt"}], {})
    assert latest_checkpoint(tmp_path).name == "step_00000001"


@pytest.mark.parametrize("damage", ["truncated rank", "empty meta", "missing rank", "flipped byte"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_valid_one(tmp_path, damage):
    _save(tmp_path, 1)
    latest = _save(tmp_path, 2)
    target = latest / "rank0.pt"
    if damage == "truncated rank":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "empty meta":
        (latest / "meta.json").write_text("")
    elif damage == "missing rank":
        (latest / "rank1.pt").unlink()
    else:
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    path, damaged = latest_valid(tmp_path)
    assert path.name == "step_00000001" and read_file(path, "rank0.pt")["pos"] == 8
    assert [p.name for p, _ in damaged] == ["step_00000002"] and damaged[0][1]
    assert latest_checkpoint(tmp_path) == path


def test_no_valid_checkpoint_is_deleted_before_its_successor_verifies(tmp_path):
    _save(tmp_path, 1, keep=1)
    (tmp_path / "step_00000001" / "meta.json").write_text("{}")  # damaged: left for inspection, never counted
    _save(tmp_path, 2, keep=1)  # as one of the `keep` valid ones
    _save(tmp_path, 3, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000003"]
    files = [write_file(tmp_path, 4, "rank0.pt", {"x": 4})]
    files[0]["sha256"] = "0" * 64  # what a bad disk would make of it
    with pytest.raises(RuntimeError, match="did not verify after writing"):
        finalize(tmp_path, 4, files, {"world_size": 1}, keep=1)
    assert latest_checkpoint(tmp_path).name == "step_00000003"  # the last good one is still there


def test_rng_state_round_trip():
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_tensor_mismatch_names_the_first_differences_and_counts_them():
    model = {f"w{i}": torch.zeros(2, 3) for i in range(5)}
    assert tensor_mismatch(dict(model), model) is None
    saved = {f"w{i}": torch.zeros(2, 4) for i in range(1, 5)} | {"extra": torch.zeros(1)}
    assert tensor_mismatch(saved, model) == (
        "1 only in this run's model: w0; 1 only in the checkpoint: extra; 4 of another shape: "
        "w1 [2, 4] (the model's: [2, 3]), w2 [2, 4] (the model's: [2, 3]) and 2 more")


def test_a_full_disk_says_so_with_the_path_and_leaves_no_partial_file(tmp_path):
    """The file being written is /dev/full (every write fails with ENOSPC, as on a full disk): the error says
    "no space left on device" with the checkpoint file's path, and the half-written file is gone."""
    import errno
    import os

    partial = tmp_path / "step_00000001.partial"
    partial.mkdir()
    os.symlink("/dev/full", partial / "rank0.pt.tmp")
    with pytest.raises(OSError) as err:
        write_file(tmp_path, 1, "rank0.pt", {"w": torch.zeros(1 << 16)})
    assert err.value.errno == errno.ENOSPC
    assert f"no space left on device for {partial / 'rank0.pt'}" in str(err.value)
    assert "checkpoint.dir" in str(err.value) and not list(partial.iterdir())


def test_files_another_writer_made_are_hashed_published_and_verified(tmp_path):
    """A directory of files written by someone else (Megatron's distributed checkpoint): their records, by
    path relative to the step, are published and checked like the ranks' own files."""
    import hashlib

    from qurl_mcore.checkpoint import format_of, hash_files, partial_dir

    inner = partial_dir(tmp_path, 1) / "trainer"
    inner.mkdir(parents=True)
    (inner / "__0_0.distcp").write_bytes(b"slices" * 100)
    records = hash_files(partial_dir(tmp_path, 1), ["trainer/__0_0.distcp"])
    assert records == [{"file": "trainer/__0_0.distcp", "bytes": 600,
                        "sha256": hashlib.sha256(b"slices" * 100).hexdigest()}]
    path = finalize(tmp_path, 1, records, {"format": "torch_dist", "world_size": 1})
    assert verify(path) is None and format_of(read_meta(path)) == "torch_dist"
    (path / "trainer" / "__0_0.distcp").write_bytes(b"slicez" * 100)
    assert verify(path) == "trainer/__0_0.distcp does not match its checksum"
    assert format_of({}) == "torch"  # written before the format was recorded


def test_export_takes_the_newest_checkpoint_and_refuses_a_damaged_newest_one(tmp_path):
    """`qurl export CHECKPOINT_DIR` must not pass off an older step as the run's last: with the newest one
    damaged it refuses, naming it and the valid one to give instead; a step_N given itself is taken."""
    from qurl_mcore.export import checkpoint_to_export

    older = _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    assert checkpoint_to_export(tmp_path) == newest
    (newest / "rank0.pt").write_bytes(b"")
    with pytest.raises(ValueError) as refused:
        checkpoint_to_export(tmp_path)
    assert str(refused.value) == (f"{tmp_path}: the newest checkpoint, step_00000002, is damaged (rank0.pt has 0 "
                                  f"bytes, {read_meta(newest)['files'][0]['bytes']} were written); to export the "
                                  f"newest valid one, give it: {older}")
    assert checkpoint_to_export(older) == older


class _Usage:
    def __init__(self, free: int):
        self.free = free


def test_a_save_is_refused_before_it_starts_when_the_disk_cannot_hold_it(tmp_path, monkeypatch):
    import errno
    import shutil

    from qurl_mcore import checkpoint

    newest = _save(tmp_path, 1)
    size = sum(r["bytes"] for r in read_meta(newest)["files"])
    checkpoint.check_space(tmp_path)  # this disk holds another one
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(size - 1))
    with pytest.raises(OSError, match=rf"{tmp_path} has 0 MiB free, and a checkpoint takes 0 MiB "
                                      r"\(step_00000001\); free space there") as full:
        checkpoint.check_space(tmp_path)
    assert full.value.errno == errno.ENOSPC


def test_a_distributed_save_that_fills_the_disk_is_named_and_its_partial_removed(tmp_path, monkeypatch):
    """Megatron's distributed save reports a full disk as a short write ("unexpected pos"), the ENOSPC
    underneath lost: a write that fails with hardly any space left is taken for what it is."""
    import shutil

    from qurl_mcore.checkpoint import NEARLY_FULL_BYTES, partial_dir
    from qurl_mcore.loop.trainer import _space_named

    partial = partial_dir(tmp_path, 3)
    (partial / "trainer").mkdir(parents=True)
    (partial / "trainer" / "__0_0.distcp").write_bytes(b"x" * 100)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # another failure, with space left: itself
        with _space_named(partial):
            raise RuntimeError("CheckpointException: unexpected pos 704 vs 598")
    assert partial.is_dir()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(NEARLY_FULL_BYTES - 1))
    with pytest.raises(OSError, match=rf"no space left on device for {partial} \(its partial files are removed\); "
                                      "free space there or set checkpoint.dir to another disk"):
        with _space_named(partial):
            raise RuntimeError("CheckpointException: unexpected pos 704 vs 598")
    assert not partial.exists()
