"""`qurl compare`: several configs x several seeds, then one report of the curves with their spread over seeds.

Each (config, seed) is one `qurl train` run in its own directory, OUT/<label>/seed<k>/ (checkpoints/, logs/,
train.log: what the run printed, run.json: written when it finished). The runs start seed after seed (so that
an interrupted study already has every config at its first seeds), `jobs` of them at once (default 1: one after
another). Each run is its own `qurl train` with its own Ray: a local one of its own, or the cluster at
RAY_ADDRESS, which then must have room for `jobs` runs' trainer and engine actors (a run whose actors do not fit
waits for them).

Resumable: a run whose run.json says it reached the config's steps is skipped (refused if its config has
changed since, other than `steps`); any other run is started with the same command, and `qurl train`
resumes it from its last checkpoint. Ctrl-C stops the running runs with a checkpoint and starts no other.

Records name their code (`qurl_mcore.provenance`): code.json holds the commit (and whether the tree had changes)
that started a run, run.json the one that finished it, and the report shows each run's. A label whose runs were
or would be made by different code is refused before anything starts (a row must compare like with like), unless
`mixed_commits` (`--mixed-commits`) says that is meant.

A config is a `qurl train` YAML file; with `--base`, it is a partial one whose fields override the base's
(one base per study, a few lines per variant). `--set key=value` applies to every run.

The report (OUT/report/): curves.png, one panel per metric of `METRICS` that some run logged, each label's
mean over seeds with a min-max band; table.md and table.json, per label and metric the mean over seeds of
each run's mean over its last k steps, ± the sample standard deviation across seeds.
"""
from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .config import Config, flatten, load_config, read_yaml, to_dict
from .loop.outcome import EXIT_FINISHED, EXIT_STOPPED
from .loop.tracking import read_metrics
from .provenance import CodeVersion, code_version

#: (metric, title) in report order; a metric no run logged is left out
METRICS: tuple[tuple[str, str], ...] = (
    ("reward/mean", "reward"),
    ("eval/accuracy", "eval accuracy"),
    ("eval/accuracy_bf16", "eval accuracy (bf16 weights)"),
    ("mismatch/abs_logprob_diff", "|log π_train − log π_rollout|"),
    ("mismatch/kl_k1", "KL(π_behav ‖ π_prox)"),
    ("uaq/update_capture", "update capture"),
    ("mismatch/topk_match", "top-k expert match"),
    ("time/step", "step time (s)"),
)

#: fields compare sets for each run itself
PER_RUN_FIELDS = ("seed", "checkpoint.dir", "logging.dir")
RUN_RESULT = "run.json"
#: the code that started a run (written at its first start)
RUN_CODE = "code.json"
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]*$")


# ---- aggregation: pure functions over metric records ----------------------------------------------------------

def series(records: Sequence[Mapping], name: str) -> dict[int, float]:
    """step -> value of metric `name` in one run's records (steps without a finite value left out)."""
    return {r["step"]: float(r[name]) for r in records if r.get(name) is not None and math.isfinite(r[name])}


def band(runs: Sequence[Mapping[int, float]]) -> list[tuple[int, float, float, float]]:
    """(step, mean, min, max) over the runs that logged each step, in step order."""
    steps = sorted(set().union(*runs)) if runs else []
    out = []
    for step in steps:
        values = [run[step] for run in runs if step in run]
        out.append((step, statistics.fmean(values), min(values), max(values)))
    return out


def last_k_mean(run: Mapping[int, float], k: int, end: int) -> float | None:
    """The mean of a metric over the last `k` steps of a run that ended at step `end`: its values at steps
    end − k < step <= end (a metric logged every few steps, like eval/*, has fewer there); None when none."""
    values = [value for step, value in run.items() if end - k < step <= end]
    return statistics.fmean(values) if values else None


def spread(values: Sequence[float]) -> dict:
    """{"mean", "std", "n"} of per-seed values; std is the sample standard deviation (n − 1), None for n < 2."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values)}


def summarize(runs: Mapping[str, Sequence[Sequence[Mapping]]], k: int) -> dict[str, dict[str, dict]]:
    """metric -> label -> spread of the runs' last-k means (each run's window ends at its last step), from
    label -> each seed's records; a metric no run of a label logged there is absent for that label, one no run
    logged at all is absent."""
    table: dict[str, dict[str, dict]] = {}
    for name, _ in METRICS:
        for label, seeds in runs.items():
            means = (last_k_mean(series(r, name), k, max(x["step"] for x in r)) for r in seeds if r)
            per_seed = [m for m in means if m is not None]
            if per_seed:
                table.setdefault(name, {})[label] = {**spread(per_seed), "per_seed": per_seed}
    return table


def format_cell(cell: dict | None) -> str:
    """'mean ± std' in three significant digits; '—' for no data, no '±' for one seed."""
    if cell is None:
        return "—"
    text = f"{cell['mean']:.3g}"
    return text if cell["std"] is None else f"{text} ± {cell['std']:.2g}"


def format_table(table: dict[str, dict[str, dict]], labels: Sequence[str], k: int) -> str:
    """The summary as a markdown table: a row per label, a column per metric."""
    titles = dict(METRICS)
    names = [n for n, _ in METRICS if n in table]
    seeds = {label: max((table[n][label]["n"] for n in names if label in table[n]), default=0) for label in labels}
    lines = [f"Mean over the last {k} steps of each run, mean ± sample std across seeds.", "",
             "| run | seeds | " + " | ".join(titles[n].replace("|", "\\|") for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for label in labels:
        cells = [format_cell(table[n].get(label)) for n in names]
        lines.append(f"| {label} | {seeds[label]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---- the runs -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    config: Path
    label: str


def parse_variant(text: str) -> Variant:
    """CONFIG[:LABEL]; the label (a directory name in OUT) defaults to the file's stem."""
    path, _, label = text.rpartition(":") if ":" in text else (text, "", "")
    label = label or Path(path).stem
    if not _LABEL.match(label):
        raise ValueError(f"{text!r}: label {label!r} must be letters, digits and _.+=- (it names a directory); "
                         "give one as CONFIG:LABEL")
    if not Path(path).is_file():
        raise ValueError(f"{text!r}: config file {path} does not exist")
    return Variant(Path(path), label)


def as_overrides(data: Mapping) -> list[str]:
    """A (partial) config mapping as `key=value` overrides: a string that YAML reads back as itself as it is,
    any other value in JSON (which YAML reads)."""
    # lazy: PyYAML only where overrides are written; `qurl --help` imports this module
    import yaml

    def text(value) -> str:
        return value if isinstance(value, str) and yaml.safe_load(value) == value else json.dumps(value)

    return [f"{key}={text(value)}" for key, value in flatten(data).items()]


@dataclass(frozen=True)
class Run:
    variant: Variant
    seed: int
    dir: Path
    config: Path  # the YAML file `qurl train` reads
    overrides: tuple[str, ...]  # then these, the run's own last
    cfg: Config

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "qurl_mcore", "train", "--config", str(self.config), *self.overrides]

    @property
    def name(self) -> str:
        return f"{self.variant.label} seed {self.seed}"


def runs_of(variants: Sequence[Variant], seeds: Sequence[int], out: Path, base: Path | None = None,
            overrides: Sequence[str] = ()) -> list[Run]:
    """Every run, seed-major, each config loaded and checked (ConfigError lists every problem of the first bad
    one) before anything starts."""
    labels = [v.label for v in variants]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(f"labels {twice} name several configs; give each its own as CONFIG:LABEL")
    reserved = [o for o in overrides if o.split("=", 1)[0].strip() in PER_RUN_FIELDS]
    if reserved:
        raise ValueError(f"--set {reserved}: compare sets {', '.join(PER_RUN_FIELDS)} for each run; choose seeds "
                         "with --seeds and the directory with --out")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {list(seeds)}: a seed is given twice")
    runs = []
    for seed in seeds:
        for v in variants:
            run_dir = out / v.label / f"seed{seed}"
            own = [f"seed={seed}", f"checkpoint.dir={run_dir / 'checkpoints'}", f"logging.dir={run_dir / 'logs'}",
                   "logging.progress=false"]  # the run prints to train.log, where a progress bar is noise
            layered = as_overrides(read_yaml(v.config) or {}) if base else []
            args = (*layered, *overrides, *own)
            config = base or v.config
            runs.append(Run(v, seed, run_dir, config, args, load_config(config, list(args))))
    return runs


def finished(run: Run) -> bool:
    """Whether the run reached its config's steps (its run.json); raises ValueError when it was made with a
    different config than now (other than `steps`, which may grow: the run then resumes)."""
    path = run.dir / RUN_RESULT
    if not path.is_file():
        return False
    done = json.loads(path.read_text())
    before, now = flatten(done["config"]), flatten(to_dict(run.cfg))
    # more steps resume the run; the same run may move; a field the code added or removed since is no change
    free = {"steps", "checkpoint.dir", "logging.dir"}
    changed = sorted(k for k in (before.keys() & now.keys()) - free if before[k] != now[k])
    if changed:
        diffs = ", ".join(f"{k} {before[k]!r} -> {now[k]!r}" for k in changed[:5])
        raise ValueError(f"{run.dir} was run with another config ({diffs}); remove that directory to redo it, "
                         "or put the config back")
    return done["steps"] >= run.cfg.steps


@dataclass
class Outcome:
    report: Path
    failed: list[str]  # runs that ended with an error (their train.log says why)
    stopped: bool  # interrupted: the current run checkpointed, the later ones were not started


def _recorded(run: Run, name: str) -> str | None:
    """The code label (`CodeVersion.label`) in the run's `name` record; None without one (or from before
    records named their code)."""
    path = run.dir / name
    if not path.is_file():
        return None
    done = json.loads(path.read_text())
    return CodeVersion(done["commit"], done.get("dirty")).label() if "commit" in done else None


def code_of(run: Run, now: CodeVersion | None = None) -> set[str]:
    """The code that made the run so far (what finished it: run.json; else what started it: code.json;
    "unrecorded" for records from before they named their code), and `now` when it is to run again."""
    if (run.dir / RUN_RESULT).is_file():
        code = {_recorded(run, RUN_RESULT) or "unrecorded"}
    else:
        code = {_recorded(run, RUN_CODE)} - {None}
    return code | {now.label()} if now is not None else code


def check_commits(runs: Sequence[Run], todo: Sequence[bool], now: CodeVersion) -> None:
    """Refuse a label whose runs are or would be made by different code (`todo`: which runs `now`, the
    code of this invocation, is about to run)."""
    by_label: dict[str, set[str]] = {}
    for run, runs_now in zip(runs, todo):
        by_label.setdefault(run.variant.label, set()).update(code_of(run, now if runs_now else None))
    mixed = {label: sorted(code) for label, code in by_label.items() if len(code) > 1}
    if mixed:
        rows = "; ".join(f"{label}: {', '.join(code)}" for label, code in mixed.items())
        raise ValueError(f"runs of different code would share a row ({rows}): check out the commit the study "
                         "was made with, or start it again in a new --out, or pass --mixed-commits to put "
                         "them in one row anyway")


def _code_record(code: CodeVersion) -> dict:
    return {"commit": code.commit, "dirty": code.dirty, "version": code.version}


def start(run: Run, code: CodeVersion) -> subprocess.Popen:
    """Start `qurl train` for one run, its output appended to train.log; the first start records `code`."""
    run.dir.mkdir(parents=True, exist_ok=True)
    if not (run.dir / RUN_CODE).is_file():
        (run.dir / RUN_CODE).write_text(json.dumps(_code_record(code)))
    with open(run.dir / "train.log", "ab") as log:  # the child keeps its own descriptor
        log.write(f"$ {shlex.join(run.command)}  # code {code.label()}\n".encode())
        log.flush()
        return subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT)


def conclude(run: Run, code: int, wall_s: float, version: CodeVersion, drop_checkpoints: bool = False) -> None:
    """After a run's `qurl train` exited with `code` (`qurl_mcore.loop.outcome`): run.json (with the code
    `version` that finished it) if it finished, and its checkpoints deleted if asked."""
    if code == EXIT_FINISHED:
        (run.dir / RUN_RESULT).write_text(json.dumps(
            {"steps": run.cfg.steps, "wall_s": round(wall_s, 1), **_code_record(version), "config": to_dict(run.cfg)}))
        if drop_checkpoints:
            shutil.rmtree(run.cfg.checkpoint.dir, ignore_errors=True)


def compare(variants: Sequence[Variant], seeds: Sequence[int], out: Path, *, base: Path | None = None,
            overrides: Sequence[str] = (), last: int = 4, report_only: bool = False, drop_checkpoints: bool = False,
            jobs: int = 1, mixed_commits: bool = False, say: Callable[[str], None] = print) -> Outcome:
    """Run what is not finished yet (nothing with `report_only`), up to `jobs` runs at once, then write the
    report from every run's metrics so far. `drop_checkpoints` deletes a run's checkpoints once it finished (a
    study's runs are 1.6 GB each with SmolLM2); a run made longer later then starts over. `mixed_commits` lets
    one label's runs come from different code (refused otherwise, before anything starts)."""
    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: at least one run at a time")
    runs = runs_of(variants, seeds, Path(out), base, overrides)
    done = [finished(run) for run in runs]  # every changed config refused before anything starts
    version = code_version()
    if not mixed_commits:
        check_commits(runs, [not (was_done or report_only) for was_done in done], version)
    todo = []
    for i, (run, was_done) in enumerate(zip(runs, done) if not report_only else [], 1):
        if was_done:
            say(f"[{i}/{len(runs)}] {run.name}: finished before, skipped")
        else:
            todo.append((f"[{i}/{len(runs)}] {run.name}", run))
    failed, stopped = [], False
    running: dict[str, tuple[Run, subprocess.Popen, float]] = {}
    try:
        while todo or running:
            while todo and len(running) < jobs and not stopped:
                where, run = todo.pop(0)
                say(f"{where}: running {run.cfg.steps} steps (log {run.dir / 'train.log'})")
                running[where] = (run, start(run, version), time.monotonic())
            if stopped and not running:
                break
            ended = [(w, r, p.returncode, t) for w, (r, p, t) in running.items() if p.poll() is not None]
            if not ended:
                time.sleep(0.2)
            for where, run, code, began in ended:
                del running[where]
                conclude(run, code, time.monotonic() - began, version, drop_checkpoints)
                if code == EXIT_STOPPED:
                    say(f"{where}: stopped with a checkpoint; run the same command to resume")
                    stopped = True
                elif code != EXIT_FINISHED:
                    say(f"{where}: failed (exit {code}); see {run.dir / 'train.log'}")
                    failed.append(run.name)
                else:
                    say(f"{where}: done in {time.monotonic() - began:.0f} s")
    except KeyboardInterrupt:  # the runs got the same SIGINT: each writes a checkpoint and exits
        for where, (run, process, began) in running.items():
            conclude(run, process.wait(), time.monotonic() - began, version, drop_checkpoints)
            say(f"{where}: stopped with a checkpoint; run the same command to resume")
        stopped = True
    return Outcome(write_report(runs, Path(out) / "report", last), failed, stopped)


# ---- the report ----------------------------------------------------------------------------------------------

def _records(runs: Sequence[Run]) -> dict[str, dict[int, list[dict]]]:
    """label -> seed -> the run's records up to its config's steps (none yet: an empty list), in run order."""
    out: dict[str, dict[int, list[dict]]] = {}
    for run in runs:
        path = Path(run.cfg.logging.dir) / "metrics.jsonl"
        records = read_metrics(path) if path.is_file() else []
        out.setdefault(run.variant.label, {})[run.seed] = [r for r in records if r["step"] <= run.cfg.steps]
    return out


def plot(records: Mapping[str, Sequence[Sequence[Mapping]]], path: Path) -> list[str]:
    """curves.png: a panel per metric some run logged, each label's mean with its min-max band over seeds.
    Returns the metrics plotted."""
    # matplotlib (slow to import, optional) only where a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    # pyplot after use("Agg"): it picks its backend when first imported
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    bands = {name: {label: band([series(r, name) for r in seeds]) for label, seeds in records.items()}
             for name, _ in METRICS}
    names = [n for n, _ in METRICS if any(bands[n].values())]
    if not names:
        return []
    cols = min(2, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 2.8 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes.flat, names):
        for i, (label, points) in enumerate(bands[name].items()):
            if not points:
                continue
            steps, mean, low, high = zip(*points)
            color = colors[i % len(colors)]
            ax.plot(steps, mean, color=color, marker="o", markersize=2.5, linewidth=1.2, label=label)
            ax.fill_between(steps, low, high, color=color, alpha=0.18, linewidth=0)
        ax.set_title(dict(METRICS)[name], fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    legend = {}  # label -> line, from every panel (a label may lack the first panel's metric)
    for ax in axes.flat:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(legend.values(), legend.keys(), loc="upper center", ncol=min(len(legend), 5), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (2.8 * rows)))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return names


def write_report(runs: Sequence[Run], out_dir: Path, last: int) -> Path:
    """curves.png, table.md, table.json and report.md (which shows the other two) in `out_dir`; returns
    report.md. table.json also holds, per run, the steps it logged, the wall time of the `qurl train`
    invocation that finished it and the code that made it (`code_of`)."""
    by_seed = _records(runs)
    records = {label: [r for r in seeds.values() if r] for label, seeds in by_seed.items()}
    labels = list(records)
    table = summarize(records, last)
    plotted = plot(records, out_dir / "curves.png")
    text = format_table(table, labels, last)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(text)
    logged: dict[str, dict[int, dict]] = {}
    for run in runs:
        result = run.dir / RUN_RESULT
        wall = json.loads(result.read_text())["wall_s"] if result.is_file() else None
        logged.setdefault(run.variant.label, {})[run.seed] = {"steps": len(by_seed[run.variant.label][run.seed]),
                                                              "wall_s": wall, "code": sorted(code_of(run))}
    (out_dir / "table.json").write_text(json.dumps({"last_k": last, "metrics": table, "runs": logged}, indent=1))
    page = out_dir / "report.md"
    figure = "![curves: mean over seeds, min-max band](curves.png)\n\n" if plotted else "No run logged metrics yet.\n\n"
    code = "".join(f"| {label} | {seed} | {', '.join(run['code']) or '—'} |\n" for label, seeds in logged.items()
                   for seed, run in seeds.items())
    page.write_text(f"# qurl compare: {', '.join(labels)}\n\n{figure}{text}\n\n## Code of each run\n\n"
                    f"| label | seed | code (commit) |\n|---|---|---|\n{code}")
    return page
