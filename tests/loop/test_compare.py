"""`qurl compare`: the aggregation over seeds (values derived by hand), the run plan, the report, and (slow) two
tiny configs end to end, then a second invocation that starts nothing."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from qurl_mcore.compare import (band, compare, finished, format_cell, last_k_mean, parse_variant, runs_of, series,
                                spread, summarize)
from qurl_mcore.config import load_config, to_dict
from tests.loop.runs import TINY


def test_series_skips_absent_and_non_finite_values():
    records = [{"step": 1, "a": 0.5}, {"step": 2, "a": None}, {"step": 3}, {"step": 4, "a": float("nan")},
               {"step": 5, "a": 2}]
    assert series(records, "a") == {1: 0.5, 5: 2.0}
    assert series(records, "b") == {}


def test_band_is_mean_min_max_over_the_seeds_that_logged_each_step():
    a, b = {1: 0.0, 2: 0.5, 3: 1.0}, {1: 0.2, 2: 0.1}
    got = band([a, b])
    assert [s for s, *_ in got] == [1, 2, 3]
    for (_, mean, low, high), want in zip(got, [(0.1, 0.0, 0.2), (0.3, 0.1, 0.5), (1.0, 1.0, 1.0)]):
        assert (mean, low, high) == pytest.approx(want)
    assert band([]) == []


def test_last_k_mean_and_spread():
    assert last_k_mean({3: 1.0, 1: 0.0, 2: 0.5}, 2, end=3) == pytest.approx(0.75)  # steps 2 and 3
    assert last_k_mean({1: 0.2, 2: 0.1}, 5, end=2) == pytest.approx(0.15)  # fewer steps than k: all of them
    assert last_k_mean({0: 0.1, 4: 0.3, 8: 0.5}, 4, end=8) == 0.5  # logged every 4 steps: step 8 alone
    assert last_k_mean({0: 0.1, 4: 0.3, 8: 0.5}, 5, end=8) == pytest.approx(0.4)  # steps 4 and 8
    assert last_k_mean({1: 0.2}, 2, end=5) is None  # not logged in steps 4-5
    assert last_k_mean({}, 3, end=3) is None
    s = spread([0.75, 0.15])
    assert s["mean"] == pytest.approx(0.45) and s["n"] == 2
    assert s["std"] == pytest.approx(0.3 * math.sqrt(2))  # deviations ±0.3, sum of squares 0.18 over n − 1 = 1
    assert spread([0.4]) == {"mean": 0.4, "std": None, "n": 1}


def test_summarize_per_metric_and_label():
    def run(*rewards, capture=None):
        return [{"step": i + 1, "reward/mean": r, **({"uaq/update_capture": capture} if capture else {})}
                for i, r in enumerate(rewards)]

    table = summarize({"int8": [run(0.0, 0.5, 1.0, capture=0.01), run(0.2, 0.2, 0.4, capture=0.03)],
                       "bf16": [run(0.1, 0.3, 0.5)]}, k=2)
    assert set(table) == {"reward/mean", "uaq/update_capture"}  # nothing else was logged
    assert table["reward/mean"]["int8"]["per_seed"] == pytest.approx([0.75, 0.3])
    assert table["reward/mean"]["int8"]["mean"] == pytest.approx(0.525)
    assert table["reward/mean"]["int8"]["std"] == pytest.approx(0.225 * math.sqrt(2))
    assert table["reward/mean"]["bf16"] == {"mean": pytest.approx(0.4), "std": None, "n": 1,
                                            "per_seed": [pytest.approx(0.4)]}
    assert set(table["uaq/update_capture"]) == {"int8"}  # bf16 has no capture: absent, not zero
    assert format_cell(table["reward/mean"]["int8"]) == "0.525 ± 0.32"
    assert format_cell(table["reward/mean"]["bf16"]) == "0.4"
    assert format_cell(None) == "—"


def test_parse_variant(tmp_path):
    config = tmp_path / "int8-s1.5.yaml"
    config.write_text("precision: int8\n")
    assert parse_variant(str(config)).label == "int8-s1.5"
    assert parse_variant(f"{config}:mine").config == config
    with pytest.raises(ValueError, match="label 'a b' must be"):
        parse_variant(f"{config}:a b")
    with pytest.raises(ValueError, match="does not exist"):
        parse_variant(str(tmp_path / "nope.yaml"))


def test_plan_layers_a_partial_config_over_the_base(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"precision": "int8", "steps": 9, "train": {"loss": "acr", "lr": 2e-5},
                                    "data": {"system_prompt": "Reply: only the number."}}))
    variant = tmp_path / "fp8.yaml"
    variant.write_text("precision: fp8\ntrain: {loss: tis, tis_cap: 3}\nuaq: {scale: 2}\n")
    runs = runs_of([parse_variant(str(variant))], [0, 3], tmp_path / "out", base, ["steps=2"])
    assert [(r.variant.label, r.seed) for r in runs] == [("fp8", 0), ("fp8", 3)]
    merged = tmp_path / "merged.yaml"  # what the layering means, written out by hand
    merged.write_text(yaml.safe_dump({"precision": "fp8", "steps": 2, "seed": 3, "uaq": {"scale": 2},
                                      "train": {"loss": "tis", "lr": 2e-5, "tis_cap": 3},
                                      "data": {"system_prompt": "Reply: only the number."},
                                      "checkpoint": {"dir": str(tmp_path / "out/fp8/seed3/checkpoints")},
                                      "logging": {"dir": str(tmp_path / "out/fp8/seed3/logs"), "progress": False}}))
    assert runs[1].cfg == load_config(merged)
    assert runs[1].command[:6] == [sys.executable, "-m", "qurl_mcore", "train", "--config", str(base)]
    assert load_config(runs[1].command[5], runs[1].command[6:]) == runs[1].cfg  # what the run will load


def test_plan_refuses_what_compare_owns_and_ambiguous_labels(tmp_path):
    config = tmp_path / "a.yaml"
    config.write_text("steps: 2\n")
    with pytest.raises(ValueError, match=r"--set \['seed=4'\]: compare sets seed"):
        runs_of([parse_variant(str(config))], [0], tmp_path, None, ["seed=4"])
    with pytest.raises(ValueError, match=r"labels \['a'\] name several configs"):
        runs_of([parse_variant(str(config)), parse_variant(str(config))], [0], tmp_path)


def _write_records(run, rewards: list[float], **extra) -> None:
    path = Path(run.cfg.logging.dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": i + 1, "reward/mean": r, **extra}) + "\n"
                            for i, r in enumerate(rewards)))


def test_finished_reads_run_json_and_refuses_a_changed_config(tmp_path):
    config = tmp_path / "a.yaml"
    config.write_text("steps: 2\n")
    out = tmp_path / "out"
    (run,) = runs_of([parse_variant(str(config))], [0], out)
    assert not finished(run)
    run.dir.mkdir(parents=True)
    (run.dir / "run.json").write_text(json.dumps({"steps": 2, "wall_s": 1.0, "config": to_dict(run.cfg)}))
    assert finished(run)
    (longer,) = runs_of([parse_variant(str(config))], [0], out, None, ["steps=3"])
    assert not finished(longer)  # more steps: resumed from its checkpoint
    (changed,) = runs_of([parse_variant(str(config))], [0], out, None, ["train.lr=3e-6"])
    with pytest.raises(ValueError, match=r"another config \(train.lr 1e-06 -> 3e-06\); remove that directory"):
        finished(changed)


def test_report_only_aggregates_what_the_runs_logged(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("steps: 3\n")
    b.write_text("steps: 3\n")
    variants = [parse_variant(f"{a}:int8"), parse_variant(f"{b}:bf16")]
    out = tmp_path / "out"
    runs = runs_of(variants, [0, 1], out)
    _write_records(runs[0], [0.0, 0.5, 1.0], **{"uaq/update_capture": 0.01})  # int8 seed 0
    _write_records(runs[1], [0.1, 0.3, 0.5])  # bf16 seed 0
    _write_records(runs[2], [0.2, 0.2, 0.4, 0.9], **{"uaq/update_capture": 0.03})  # int8 seed 1: step 4 > steps
    lines = []
    done = compare(variants, [0, 1], out, last=2, report_only=True, say=lines.append)
    assert lines == [] and done.failed == [] and not done.stopped  # nothing run
    table = json.loads((out / "report" / "table.json").read_text())
    assert table["metrics"]["reward/mean"]["int8"]["mean"] == pytest.approx((0.75 + 0.3) / 2)
    assert table["metrics"]["reward/mean"]["bf16"]["n"] == 1  # seed 1 of bf16 logged nothing
    # no run.json or code.json: runs made by hand name no code
    assert table["runs"]["int8"] == {"0": {"steps": 3, "wall_s": None, "code": []},
                                     "1": {"steps": 3, "wall_s": None, "code": []}}
    text = done.report.read_text()
    assert "| int8 | 2 | 0.525 ± 0.32 | 0.02 ± 0.014 |" in text and "| bf16 | 1 | 0.4 | — |" in text
    assert (out / "report" / "curves.png").read_bytes()[:4] == b"\x89PNG"


def _finish(run, commit: str | None, dirty: bool = False) -> None:
    run.dir.mkdir(parents=True, exist_ok=True)
    code = {"commit": commit, "dirty": dirty} if commit else {}
    (run.dir / "run.json").write_text(json.dumps({"steps": run.cfg.steps, "wall_s": 1.0, **code,
                                                  "config": to_dict(run.cfg)}))


def test_one_row_holds_runs_of_one_commit_unless_asked(tmp_path):
    """Seeds 0 and 1 of a label finished at different commits: the report refuses to average them, names
    both and the ways out, and shows each run's code when asked to mix them."""
    config = tmp_path / "int8.yaml"
    config.write_text("steps: 2\n")
    out = tmp_path / "out"
    variants = [parse_variant(str(config))]
    runs = runs_of(variants, [0, 1], out)
    a, b = "a" * 40, "b" * 40
    _finish(runs[0], a)
    _finish(runs[1], b, dirty=True)
    for run in runs:
        _write_records(run, [0.0, 1.0])
    with pytest.raises(ValueError, match=r"runs of different code would share a row \(int8: aaaaaaaaaa, "
                                         r"bbbbbbbbbb\+dirty\).*--mixed-commits"):
        compare(variants, [0, 1], out, report_only=True)
    done = compare(variants, [0, 1], out, report_only=True, mixed_commits=True)
    table = json.loads((out / "report" / "table.json").read_text())
    assert [table["runs"]["int8"][s]["code"] for s in ("0", "1")] == [["aaaaaaaaaa"], ["bbbbbbbbbb+dirty"]]
    assert "| int8 | 1 | bbbbbbbbbb+dirty |" in done.report.read_text()
    _finish(runs[1], a)  # one commit: one row
    compare(variants, [0, 1], out, report_only=True)


def test_an_unfinished_run_is_not_resumed_by_other_code(tmp_path, monkeypatch):
    """Seed 0 finished before records named their code, seed 1 is to run now: two kinds of code in one row,
    refused before anything starts (nothing is written)."""
    from qurl_mcore import compare as compare_module
    from qurl_mcore.provenance import CodeVersion

    monkeypatch.setattr(compare_module, "code_version", lambda: CodeVersion("c" * 40, False))
    config = tmp_path / "int8.yaml"
    config.write_text("steps: 2\n")
    out = tmp_path / "out"
    variants = [parse_variant(str(config))]
    runs = runs_of(variants, [0, 1], out)
    _finish(runs[0], None)
    with pytest.raises(ValueError, match=r"\(int8: cccccccccc, unrecorded\)"):
        compare(variants, [0, 1], out, say=lambda line: None)
    assert not runs[1].dir.exists()


def test_cli_refuses_a_bad_study_before_running_anything(tmp_path, capsys):
    from qurl_mcore.cli import main

    config = tmp_path / "a.yaml"
    config.write_text("train: {los: acr}\n")
    assert main(["compare", str(config), "--out", str(tmp_path / "out")]) == 2
    assert "train.los: unknown field (did you mean train.loss?)" in capsys.readouterr().err
    config.write_text("steps: 2\n")
    assert main(["compare", str(config), "--out", str(tmp_path / "out"), "--set", "logging.dir=x"]) == 2
    assert "compare sets seed, checkpoint.dir, logging.dir" in capsys.readouterr().err
    # overrides positionally, as every command takes them
    assert main(["compare", str(config), "logging.dir=x", "--out", str(tmp_path / "out")]) == 2
    assert "compare sets seed, checkpoint.dir, logging.dir" in capsys.readouterr().err
    assert main(["compare", "train.lr=1e-6", "--out", str(tmp_path / "out")]) == 2
    assert "give at least one CONFIG besides the key=value overrides" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_two_tiny_configs_then_a_second_invocation_starts_nothing(tmp_path):
    """The tiny loop of tests/loop/runs.py (tiny Llama), INT8 vs BF16 rollout, 2 steps, both runs at once
    (seed 1: each run's seed is compare's; the aggregation over seeds is derived by hand above)."""
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"model": {"path": "tiny-llama"}, "steps": 2, "checkpoint": {"export_hf": False}}))
    (tmp_path / "int8.yaml").write_text("precision: int8\n")
    (tmp_path / "bf16.yaml").write_text("precision: bf16\nuaq: {enabled: false}\n")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "qurl_mcore", "compare", str(tmp_path / "int8.yaml"), str(tmp_path / "bf16.yaml"),
               "--base", str(base), "--seeds", "1", "--out", str(out), "--last", "1", "--jobs", "2", "--set", *TINY]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    first = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.count(": running 2 steps") == 2, first.stdout
    lines = [line for line in first.stdout.splitlines() if line.startswith("qurl compare: [")]
    assert "[1/2]" in lines[0] and "[2/2]" in lines[1] and "done in" in lines[2], first.stdout  # both at once
    table = json.loads((out / "report" / "table.json").read_text())
    for label in ("int8", "bf16"):
        assert table["metrics"]["reward/mean"][label]["n"] == 1 and table["runs"][label]["1"]["steps"] == 2
    assert set(table["metrics"]["uaq/update_capture"]) == {"int8"}  # only the quantized rollout has codes to move
    report = (out / "report" / "report.md").read_text()
    assert "| int8 | 1 |" in report and "| bf16 | 1 |" in report and "curves.png" in report
    from qurl_mcore.provenance import code_version

    for path in out.glob("*/seed*/run.json"):  # the record names the code that made it
        assert json.loads(path.read_text())["commit"] == code_version().commit
    logs = sorted(out.glob("*/seed*/train.log"))
    assert len(logs) == 2 and all(p.parent.name == "seed1" for p in logs)
    before = {p: p.stat().st_size for p in logs}
    started = time.monotonic()
    second = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    took = time.monotonic() - started
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.count("finished before, skipped") == 2 and "running" not in second.stdout, second.stdout
    assert {p: p.stat().st_size for p in logs} == before  # no `qurl train` was started (each appends its command)
    assert took < 60, took
