"""Third-party warnings (Megatron-Core's "Apex is not installed", ...) stay off the console when a command fails,
for every command: `qurl` runs each one with them held back (`qurl_mcore.cli._held_warnings`)."""
import os
import subprocess
import sys
import warnings
from argparse import Namespace
from pathlib import Path

import qurl_mcore.cli as cli

ROOT = Path(__file__).resolve().parents[2]


def test_a_failing_command_that_imported_megatron_prints_its_error_alone(tmp_path):
    """`qurl export` of a directory that holds no checkpoint imports Megatron-Core (on a machine without Apex or
    Transformer Engine: 6 warnings, 12 lines) before it finds that out: the console gets the one-line error."""
    (tmp_path / "empty").mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "qurl_mcore", "export", "empty", "out"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert (done.returncode, done.stdout, done.stderr) == (2, "qurl export: empty: no valid checkpoint there\n", "")


def _warns(code: int):
    """A command that warns as a library does (from a file outside qurl_mcore) and as qurl_mcore does."""
    def command(args: Namespace) -> int:
        warnings.warn_explicit("Apex is not installed", UserWarning, "/site-packages/megatron/core/x.py", 21)
        warnings.warn_explicit("ours", UserWarning, str(Path(cli.__file__).parent / "loop" / "x.py"), 7)
        return code
    return command


def test_held_warnings_are_shown_after_a_command_that_succeeds_and_only_ours_after_one_that_fails(capsys):
    assert cli._held_warnings(_warns(2), Namespace()) == 2
    failed = capsys.readouterr().err
    assert "ours" in failed and "Apex" not in failed, failed
    assert cli._held_warnings(_warns(0), Namespace()) == 0
    succeeded = capsys.readouterr().err
    assert "ours" in succeeded and "megatron/core/x.py:21: UserWarning: Apex is not installed" in succeeded


def test_warning_options_show_every_warning_as_it_comes(monkeypatch):
    """`PYTHONWARNINGS=default qurl ...` (or `python -W`): nothing held, nothing dropped."""
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli._held_warnings(_warns(2), Namespace()) == 2
    assert [str(w.message) for w in seen] == ["Apex is not installed", "ours"]
