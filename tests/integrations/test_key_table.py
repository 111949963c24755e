"""docs/integrations.md's table from slime's flags and verl's keys to ours: every key of ours is in our config
schema, and every verl key in verl's own Megatron-trainer config (the table cannot drift from either)."""
import re
from pathlib import Path

import pytest

from qurl_mcore.config import flatten, load_config, to_dict

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def _rows() -> list[list[str]]:
    section = DOC.read_text().split("## Moving over from slime or verl")[1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| `")]


def _keys(cell: str) -> list[str]:
    """The dotted keys of a cell, with `.x` a sibling of the key before it, `a.r.r.` verl's actor_rollout_ref.
    and values (`key: value`) dropped; `++` keys (not in verl's YAML) are left out."""
    keys = []
    for token in re.findall(r"`([^`]+)`", cell):
        token = token.split(":")[0].strip().replace("a.r.r.", "actor_rollout_ref.")
        if token.startswith(".") and keys:
            token = keys[-1].rsplit(".", 1)[0] + token
        if re.fullmatch(r"[a-z_][a-z0-9_.]*", token):
            keys.append(token)
    return keys


def test_our_column_names_fields_of_the_config():
    fields = set(flatten(to_dict(load_config(None))))
    ours = [key for row in _rows() for key in _keys(row[0])]
    assert len(ours) > 30
    assert [key for key in ours if key not in fields] == []


def test_the_verl_column_names_keys_of_verls_megatron_trainer_config():
    yaml = pytest.importorskip("yaml")
    verl = pytest.importorskip("verl")
    tree = yaml.safe_load((Path(verl.__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml").read_text())

    def paths(node, prefix=""):
        for key, value in node.items():
            yield prefix + key
            if isinstance(value, dict):
                yield from paths(value, f"{prefix}{key}.")

    known = set(paths(tree))
    theirs = [key for row in _rows() for key in _keys(row[2])]
    assert len(theirs) > 30
    assert [key for key in theirs if key not in known] == []
