"""The end-of-run report: one PNG per group of metrics and an HTML page showing them, from metrics.jsonl."""
from __future__ import annotations

import html
from pathlib import Path

from .tracking import read_metrics

#: (title, metric names) per plot; a metric absent from the run is skipped.
PANELS = [
    ("Reward", ["reward/mean"]),
    ("Held-out accuracy: rollout engines vs BF16 engine", ["eval/accuracy", "eval/accuracy_bf16"]),
    ("KL(π_behav ‖ π_prox)", ["mismatch/kl_k1", "mismatch/kl_k3"]),
    ("Clip fractions", ["clip_frac/low", "clip_frac/high"]),
    ("|log π_train − log π_rollout|", ["mismatch/abs_logprob_diff"]),
    ("Update capture (share of quantized weights changed)", ["uaq/update_capture"]),
    ("MoE routing, train vs rollout (before replay)", ["mismatch/topk_match", "mismatch/topk_overlap"]),
    ("Step time split (s)", ["time/rollout", "time/ref_logprobs", "time/train", "time/push"]),
]


def write_report(metrics_path: str | Path, out_dir: str | Path) -> Path:
    """Plot every panel that has data; returns the HTML file's path."""
    # matplotlib (slow to import, optional) only where the report's figures are drawn
    import matplotlib

    matplotlib.use("Agg")
    # pyplot after use("Agg"): it picks its backend when first imported
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for index, (title, names) in enumerate(PANELS):
        series = {n: [(r["step"], r[n]) for r in records if r.get(n) is not None] for n in names}
        series = {n: pts for n, pts in series.items() if pts}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for name, pts in series.items():
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        png = out_dir / f"panel{index}.png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        sections.append(f"<h2>{html.escape(title)}</h2><img src='{png.name}' alt='{html.escape(title)}'>")
    page = out_dir / "report.html"
    page.write_text("<!doctype html><meta charset='utf-8'><title>qurl run report</title>"
                    f"<h1>qurl run report ({sum(r['step'] > 0 for r in records)} steps)</h1>" + "".join(sections))
    return page
