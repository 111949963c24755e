"""The pinned verl 0.9.1 set (patches/verl/0.9.1) on a temporary copy of the installed verl files: it applies
once, the patched modules compile, and revert restores every file byte for byte."""
from __future__ import annotations

from .copies import installed_copy

SERVER = "verl/workers/rollout/sglang_rollout/async_sglang_server.py"


def test_verl_set_applies_once_and_reverts_exactly(tmp_path):
    ps = installed_copy("verl", tmp_path)
    files = sorted({fp.path for file_patches in ps.patches.values() for fp in file_patches})
    originals = {rel: (tmp_path / rel).read_bytes() for rel in files}
    assert set(ps.status().values()) == {"clean"}  # the second patch stacks on the first's file
    assert ps.apply() == sorted(ps.patches)
    for rel in files:
        text = (tmp_path / rel).read_text()
        assert (tmp_path / rel).read_bytes() != originals[rel]
        compile(text, rel, "exec")  # still Python
    assert "dataclasses.fields(ServerArgs)" in originals[SERVER].decode()  # verl 0.9.1's :375, which SGLang 0.5.23
    assert "dataclasses.fields(ServerArgs)" not in (tmp_path / SERVER).read_text()  # fails on (a msgspec struct)
    assert ps.apply() == [] and set(ps.status().values()) == {"applied"}
    assert ps.revert() == sorted(ps.patches, reverse=True)
    assert {rel: (tmp_path / rel).read_bytes() for rel in files} == originals
    assert not ps.manifest_path.exists()
