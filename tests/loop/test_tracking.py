"""Metrics log (JSONL + TensorBoard) and the report."""
import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from qurl_mcore.loop.report import write_report
from qurl_mcore.loop.tracking import MetricsLog, read_metrics


def test_log_truncate_and_tensorboard(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 6):
        log.log(step, {"reward/mean": step / 10, "mismatch/kl_k3": 0.01 * step, "loss/total": math.nan})
    log.truncate(3)  # a resumed run whose checkpoint is step 3
    log.log(4, {"reward/mean": 0.45})
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[3]["reward/mean"] == 0.45 and records[0]["loss/total"] is None
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    values = [e.value for e in events.Scalars("reward/mean")]
    assert [round(v, 6) for v in values[:3]] == [0.1, 0.2, 0.3]  # TensorBoard stores float32
    assert "loss/total" not in events.Tags()["scalars"]  # NaN never reaches the plots


def test_report_has_a_png_per_panel_with_data(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 4):
        log.log(step, {"reward/mean": 0.1 * step, "clip_frac/high": 0.0, "uaq/update_capture": 0.2})
    log.close()
    page = write_report(tmp_path / "metrics.jsonl", tmp_path / "report")
    text = page.read_text()
    assert "Reward" in text and "Clip fractions" in text and "Update capture" in text
    assert "KL(" not in text  # no data, no panel
    pngs = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert len(pngs) == 3 and all((tmp_path / "report" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
