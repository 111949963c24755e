"""What the user docs tell a user to type is what the code takes: every `key=value` override of the config
that docs/troubleshooting.md and the README suggest loads, and the exit codes they give are `qurl train`'s."""
import dataclasses
import re
from pathlib import Path

import pytest

from qurl_mcore.config import Config, load_config
from qurl_mcore.loop.outcome import EXIT_BAD_CONFIG, EXIT_FAILED, EXIT_STOPPED

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {f.name for f in dataclasses.fields(Config)}
PLACEHOLDER = re.compile(r"[A-Z_]+|\.\.\.|.*[<>].*")  # `rollout.engines=E`, `checkpoint.dir=...`


def _overrides(path: Path) -> list[str]:
    """The config overrides written in inline code spans (code blocks left out: they pair their own backticks)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    tokens = [tok for span in re.findall(r"`([^`]+)`", text) for tok in span.split()]
    return [tok for tok in tokens if (m := re.fullmatch(r"([a-z_0-9]+)((?:\.[a-z_0-9]+)*)=(\S+)", tok))
            and m[1] in SECTIONS and not PLACEHOLDER.fullmatch(m[3])]


@pytest.mark.parametrize("doc", ["docs/troubleshooting.md", "README.md"])
def test_every_override_the_docs_suggest_loads(doc):
    overrides = _overrides(ROOT / doc)
    assert doc == "README.md" or overrides  # troubleshooting.md suggests some
    for override in overrides:
        load_config(None, [override])  # raises ConfigError naming it


def test_the_troubleshooting_exit_codes_are_qurl_trains():
    text = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split())
    assert (f"`qurl train` exits {EXIT_FAILED} when the run failed and {EXIT_STOPPED} when it stopped with a "
            "checkpoint") in text
    assert f"Every command exits {EXIT_BAD_CONFIG} on bad input" in text


def test_the_readme_says_one_thing_about_gpus():
    """The current tree has not run on a GPU; an earlier one's trainer checks ran on an H200: the README may say
    both, but never that this tree has run on one."""
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "current tree has not run on a GPU" in text
    assert not re.search(r"(?<!earlier tree's )(path|trainer) has run on one H200", text)
