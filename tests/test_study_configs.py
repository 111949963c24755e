"""The study configs (launch/configs/studies, docs/studies.md): every variant, layered on its study's base as
`qurl compare --base` layers it, passes `qurl train --check` on this machine."""
from __future__ import annotations

from pathlib import Path

import pytest

from qurl_mcore.compare import parse_variant, runs_of
from qurl_mcore.preflight import preflight

STUDIES = Path(__file__).resolve().parents[1] / "launch" / "configs" / "studies"
# each study directory and the base its docs/studies.md command names
BASES = {"objectives": "objectives/base.yaml", "uaq": "uaq/base.yaml", "moe": "moe/base.yaml",
         "smoothing": "objectives/base.yaml"}
VARIANTS = sorted(p for p in STUDIES.glob("*/*.yaml") if p.name != "base.yaml")


def test_every_study_directory_has_its_base():
    assert sorted(p.name for p in STUDIES.iterdir() if p.is_dir()) == sorted(BASES)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_study_variant_passes_the_check(variant, tmp_path):
    (run,) = runs_of([parse_variant(str(variant))], [0], tmp_path, STUDIES / BASES[variant.parent.name])
    check = preflight(run.cfg, use_gpu=False, local=True)
    assert check.ok, check.report()
