"""`qurl patch` round trips on a temporary copy of installed package files (the venv is never touched)."""
from __future__ import annotations

import difflib
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from qurl_mcore.patching import PatchError, PatchSet, TARGETS
from qurl_mcore.patching.diff import apply_text, parse
from qurl_mcore.patching.tool import default_patch_dir

SITE = Path(metadata.distribution("sglang").locate_file(""))
FILES = ["sglang/srt/state_capturer/base.py", "sglang/version.py"]


def _diff(rel: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{rel}", f"b/{rel}"))


@pytest.fixture
def copy(tmp_path):
    """Installed sglang files copied under tmp/site, and a pinned test patch set for them under tmp/patches."""
    site = tmp_path / "site"
    for rel in FILES:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SITE / rel, site / rel)
    base = (site / FILES[0]).read_text()
    assert "pin_memory=True," in base
    unpinned = base.replace("pin_memory=True,", "pin_memory=_is_cuda or _is_hip,")
    logged = unpinned.replace("class BaseHostCache:\n", "class BaseHostCache:\n    # host side of a capture\n")
    version = (site / FILES[1]).read_text()
    pset = tmp_path / "patches" / "sglang" / "0.5.23"
    pset.mkdir(parents=True)
    (pset / "01-unpinned.patch").write_text(_diff(FILES[0], base, unpinned))
    (pset / "02-two-files.patch").write_text(_diff(FILES[0], unpinned, logged)
                                            + _diff(FILES[1], version, version + "# patched\n"))
    originals = {rel: (site / rel).read_bytes() for rel in FILES}
    return site, tmp_path / "patches", originals


def test_apply_is_idempotent_and_revert_is_exact(copy):
    site, patches, originals = copy
    ps = PatchSet.load("sglang", site, "0.5.23", patches)
    assert ps.status() == {"01-unpinned.patch": "clean", "02-two-files.patch": "clean"}
    assert ps.apply() == ["01-unpinned.patch", "02-two-files.patch"]
    text = (site / FILES[0]).read_text()
    assert "pin_memory=_is_cuda or _is_hip," in text and "# host side of a capture" in text
    assert (site / FILES[1]).read_text().endswith("# patched\n")
    recorded = ps.manifest()["applied"]
    assert set(recorded["02-two-files.patch"]) == set(FILES)
    patched = {rel: (site / rel).read_bytes() for rel in FILES}
    assert ps.apply() == []  # idempotent: nothing applied twice, nothing rewritten
    assert {rel: (site / rel).read_bytes() for rel in FILES} == patched
    assert set(ps.status().values()) == {"applied"}
    assert ps.revert() == ["02-two-files.patch", "01-unpinned.patch"]
    assert {rel: (site / rel).read_bytes() for rel in FILES} == originals
    assert not ps.manifest_path.exists()


def test_refuses_an_unpinned_version(copy):
    site, patches, _ = copy
    with pytest.raises(PatchError, match=r"sglang 0\.5\.24 is installed.*pinned to 0\.5\.23.*sglang==0\.5\.23"):
        PatchSet.load("sglang", site, "0.5.24", patches)


def test_foreign_changes_are_reported_never_overwritten(copy):
    site, patches, _ = copy
    ps = PatchSet.load("sglang", site, "0.5.23", patches)
    ps.apply()
    edited = (site / FILES[1]).read_text() + "# someone else\n"
    (site / FILES[1]).write_text(edited)
    assert ps.status()["02-two-files.patch"] == "conflict"
    with pytest.raises(PatchError, match="changed since"):
        ps.revert()
    assert (site / FILES[1]).read_text() == edited


def test_a_patch_for_other_file_contents_is_refused_whole(copy):
    site, patches, originals = copy
    (site / FILES[0]).write_text((site / FILES[0]).read_text().replace("pin_memory=True,", "pin_memory=False,"))
    ps = PatchSet.load("sglang", site, "0.5.23", patches)
    assert ps.status()["01-unpinned.patch"] == "conflict"
    with pytest.raises(PatchError, match="cannot apply"):
        ps.apply()
    assert (site / FILES[1]).read_bytes() == originals[FILES[1]]  # nothing written


def test_diff_insertions_deletions_and_reverse():
    old = "a\nb\nc\n"
    for new in ["x\na\nb\nc\n", "a\nb\nc\ny\n", "a\nc\n", "b\n", "a\nB\nc\nd\ne\n"]:
        [fp] = parse(_diff("f.py", old, new))
        assert apply_text(old, fp) == new
        assert apply_text(new, fp, reverse=True) == old
    with pytest.raises(PatchError):
        apply_text("a\nq\nc\n", parse(_diff("f.py", old, "a\nb2\nc\n"))[0])


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_pinned_sets_match_the_installed_packages(target):
    ps = PatchSet.installed(target)  # raises if the pin and the installed version disagree
    assert (default_patch_dir() / target / ps.version / "README.md").is_file()
    assert set(ps.status().values()) <= {"applied", "clean"}


def test_cli_reports_status():
    out = subprocess.run([sys.executable, "-m", "qurl_mcore", "patch", "status", "--target", "megatron"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "megatron-core 0.16.1" in out.stdout


def test_patches_stack_on_one_file(tmp_path):
    """A later patch of the same file is made against the earlier one's result, whose lines it shifts: it is
    clean (not a conflict) before anything is applied, and both go in and come back out exactly."""
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)  # the target package: the manifest goes there
    base = "".join(f"line {i}\n" for i in range(30))
    first = base.replace("line 2\n", "line 2\nadded 1\nadded 2\n")
    second = first.replace("line 20\n", "line twenty\n")
    (site / "sglang/f.py").write_text(base)
    pset = tmp_path / "patches" / "sglang" / "0.5.23"
    pset.mkdir(parents=True)
    (pset / "01-insert.patch").write_text(_diff("sglang/f.py", base, first))
    (pset / "02-after.patch").write_text(_diff("sglang/f.py", first, second))
    ps = PatchSet.load("sglang", site, "0.5.23", tmp_path / "patches")
    with pytest.raises(PatchError):  # on its own, the second patch does not fit the unpatched file
        apply_text(base, ps.patches["02-after.patch"][0])
    assert ps.status() == {"01-insert.patch": "clean", "02-after.patch": "clean"}
    assert ps.apply() == ["01-insert.patch", "02-after.patch"]
    assert (site / "sglang/f.py").read_text() == second
    assert ps.revert() == ["02-after.patch", "01-insert.patch"]
    assert (site / "sglang/f.py").read_text() == base


def test_cli_status_without_a_target_reports_every_target_and_the_others_need_one(capsys):
    from qurl_mcore.cli import main

    assert main(["patch", "status"]) == 0
    out = capsys.readouterr().out
    for target in TARGETS.values():
        assert f"{target.dist} " in out
    assert main(["patch", "apply"]) == 2
    assert "qurl patch apply: give --target, one of ['megatron', 'sglang', 'verl']" in capsys.readouterr().out
