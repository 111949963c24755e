"""The study configs (launch/configs/studies, docs/studies.md): every variant, layered on its study's base as
`qurl compare --base` layers it, passes `qurl train --check` on this machine."""
from __future__ import annotations

from pathlib import Path

import pytest

from qurl_mcore.compare import parse_variant, runs_of
from qurl_mcore.preflight import preflight

STUDIES = Path(__file__).resolve().parents[1] / "launch" / "configs" / "studies"
# each study: the directory of its variant files and the base its docs/studies.md command layers them on
RUNS = [("objectives", "objectives/base.yaml"), ("uaq", "uaq/base.yaml"), ("moe", "moe/base.yaml"),
        ("smoothing", "objectives/base.yaml"), ("moe", "moe_upcycled/base.yaml"),
        ("long", "objectives/base.yaml"), ("clip", "clip/base.yaml"), ("moe_discriminators", "moe_upcycled/base.yaml")]
CASES = [(variant, base) for folder, base in RUNS
         for variant in sorted(p.relative_to(STUDIES).as_posix() for p in (STUDIES / folder).glob("*.yaml"))
         if not variant.endswith("/base.yaml")]


def test_every_study_directory_is_run():
    named = {folder for folder, _ in RUNS} | {Path(base).parent.name for _, base in RUNS}
    assert sorted(p.name for p in STUDIES.iterdir() if p.is_dir()) == sorted(named)


@pytest.mark.parametrize(("variant", "base"), CASES, ids=[f"{v}@{Path(b).parent.name}" for v, b in CASES])
def test_study_variant_passes_the_check(variant, base, tmp_path):
    (run,) = runs_of([parse_variant(str(STUDIES / variant))], [0], tmp_path, STUDIES / base)
    check = preflight(run.cfg, use_gpu=False, local=True)
    assert check.ok, check.report()
