"""`qurl align`: MoEResQ's Table 2 on the tiny Qwen3-MoE with real SGLang rollouts scored by real Megatron.

One module-scoped run of the five MoEResQ rows and the two with routing replay (fp4+r3, fp4_rc+r3) through the
CLI (three engine starts, three Megatron models: the
expensive part, shared by every assert below; a subprocess, so Megatron's process groups stay out of the
test process). Scope "all" with MXFP4: on the tiny random model the experts-only scope moves only a token or
two of layer-1 routing (docs/align.md), while quantized attention also perturbs the routers' inputs, which
separates the precisions by wide margins.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qurl_mcore import align
from qurl_mcore.cli import main
from qurl_mcore.precision import ALIGNMENT_ROWS, PRECISIONS

PROMPTS, NEW_TOKENS = 4, 24


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    cmd = [sys.executable, "-m", "qurl_mcore", "align", "--scope", "all", "--fmt", "mxfp4", "--prompts",
           str(PROMPTS), "--max-new-tokens", str(NEW_TOKENS), "--seed", "0", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout)  # engine logs went to stderr: stdout is the JSON alone
    return {row["precision"]: row for row in out}


@pytest.mark.slow
def test_every_row_reports_every_metric(rows):
    assert list(rows) == list(align.ROWS) == [*ALIGNMENT_ROWS, "fp4+r3", "fp4_rc+r3"]
    assert list(ALIGNMENT_ROWS) == ["bf16", "fp4", "fp4_rc_rollout", "fp4_rc_train", "fp4_rc"]
    for name, row in rows.items():
        p = PRECISIONS[name.removesuffix("+r3")]
        assert (row["rollout"], row["training"]) == (p.rollout or "bf16", p.train + " + R3" * name.endswith("+r3"))
        assert (row["scope"], row["fmt"]) == ("all", "mxfp4" if p.formats else "bf16")
        # sampled to the full length unless EOS came first; the tiny model has 2 MoE layers
        assert PROMPTS <= row["tokens"] <= PROMPTS * NEW_TOKENS
        assert len(row["topk_match_by_layer"]) == 2
        assert 0 <= row["topk_match_frac"] <= row["topk_overlap_mean"] <= 1
        assert -1 <= row["pcc"] <= 1 and row["mean_abs_logprob_diff"] >= 0
    # precisions sharing a rollout method score the same sampled responses
    assert rows["fp4"]["tokens"] == rows["fp4_rc_train"]["tokens"]
    assert rows["fp4_rc_rollout"]["tokens"] == rows["fp4_rc"]["tokens"]
    assert rows["fp4+r3"]["tokens"] == rows["fp4"]["tokens"] and rows["fp4_rc+r3"]["tokens"] == rows["fp4_rc"]["tokens"]


@pytest.mark.slow
def test_routing_replay_makes_every_route_the_engines_but_not_the_probabilities(rows):
    """R3: the trainer's routers take the engine's experts for every response token and layer, so the top-k
    match is exactly 1; the token probabilities still differ (quantized vs full-precision experts), so naive
    FP4 with replay stays further from the rollout than symmetric RC without it."""
    for name in ("fp4+r3", "fp4_rc+r3"):
        assert rows[name]["topk_match_frac"] == rows[name]["topk_overlap_mean"] == 1.0
        assert rows[name]["topk_match_by_layer"] == [1.0, 1.0]
    fp4, fp4_r3, rc = rows["fp4"], rows["fp4+r3"], rows["fp4_rc"]
    assert fp4["topk_match_frac"] < 1.0  # so the replay changed something
    assert fp4_r3["mean_abs_logprob_diff"] > 0 and fp4_r3["pcc"] < 1
    assert fp4_r3["mean_abs_logprob_diff"] > rc["mean_abs_logprob_diff"]


@pytest.mark.slow
def test_bf16_sides_agree(rows):
    """Unquantized, fp32 on both sides: the same routing for every response token and near-equal
    log-probs. This also checks the position pairing: off by one, the routes would not match."""
    bf16 = rows["bf16"]
    assert bf16["topk_match_frac"] >= 0.99 and bf16["topk_overlap_mean"] >= 0.99
    assert bf16["pcc"] > 0.999
    assert bf16["mean_abs_logprob_diff"] < 1e-3


@pytest.mark.slow
def test_symmetric_rc_restores_alignment(rows):
    """MoEResQ's claim: RC on both sides aligns better than naive FP4 on every metric, near the bf16 level."""
    both, fp4 = rows["fp4_rc"], rows["fp4"]
    assert both["topk_match_frac"] > fp4["topk_match_frac"]
    assert both["topk_overlap_mean"] > fp4["topk_overlap_mean"]
    assert both["pcc"] > fp4["pcc"] and both["pcc"] > 0.99
    assert both["mean_abs_logprob_diff"] < fp4["mean_abs_logprob_diff"]
    assert both["topk_match_frac"] >= 0.95


@pytest.mark.slow
def test_one_sided_rc_misaligns(rows):
    """RC on only one side leaves the two policies further apart than RC on both (Table 2's asymmetric rows)."""
    both = rows["fp4_rc"]
    for name in ("fp4_rc_rollout", "fp4_rc_train"):
        one = rows[name]
        assert one["topk_match_frac"] < both["topk_match_frac"] - 0.05, name
        assert one["pcc"] < both["pcc"], name
        assert one["mean_abs_logprob_diff"] > 3 * both["mean_abs_logprob_diff"], name


# -- units: no engine, no Megatron ---------------------------------------------------------------------------

def test_precision_validation():
    assert align.check_precisions(None) == list(align.ROWS)
    assert align.check_precisions(["fp4_rc", "bf16", "fp4_rc"]) == ["fp4_rc", "bf16"]
    assert align.check_precisions(["fp4+r3"]) == ["fp4+r3"] and align.split_row("fp4+r3") == ("fp4", True)
    with pytest.raises(ValueError, match=r"unknown precision 'rc_both'"):
        align.check_precisions(["rc_both+r3"])
    assert align.check_precisions(["int8"]) == ["int8"]  # any precision of the table is a row
    with pytest.raises(ValueError, match=r"unknown precision 'rc_both'; use one of \['bf16'"):
        align.check_precisions(["bf16", "rc_both"])
    with pytest.raises(ValueError, match="no precisions"):
        align.check_precisions([])


def test_engine_config_quantizes_the_same_linears_as_the_trainer():
    config = align.engine_config("qurl_fp4_rc", "/m", scope="experts", fmt="mxfp4", seed=3)
    opts = config.options()
    assert (opts.method, opts.fmt, opts.scope) == ("qurl_fp4_rc", "mxfp4", "experts")
    assert config.return_routed_experts and config.dtype == "float32" and config.random_seed == 3
    assert align.engine_config(None, "/m").options() is None


def test_bad_options_fail_before_any_engine_starts(tmp_path):
    from qurl_mcore.models.tiny import tiny_checkpoint

    with pytest.raises(ValueError, match="unknown scope"):
        align.run_alignment(["bf16"], scope="attention")
    with pytest.raises(ValueError, match="not an FP4 format"):
        align.run_alignment(["fp4"], fmt="int8")
    with pytest.raises(ValueError, match="max_new_tokens"):
        align.run_alignment(["bf16"], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"dense model: routing replay \(\+r3\) needs an MoE"):
        align.run_alignment(["fp4", "fp4+r3"], tiny_checkpoint("qwen3"))
    assert align.is_moe(str(tiny_checkpoint("mixtral")))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match=r"a 'gpt2' checkpoint; use one of \['llama'"):
        align.run_alignment(["bf16"], tmp_path)
    with pytest.raises(ValueError, match="nowhere: no config.json there"):
        align.run_alignment(["bf16"], tmp_path / "nowhere")
    with pytest.raises(ValueError, match="prompts must be between 1 and 8"):
        align.run_alignment(["bf16"], prompts=9)


def test_prompts_use_the_checkpoint_tokenizer():
    ids = align.prompt_ids(str(align.default_model()), 3)
    assert len(ids) == 3 and all(len(p) > 2 for p in ids) and ids[0] != ids[1]


def test_a_dense_model_is_scored_on_log_probs_alone():
    """`paired` and `metrics` on a real Megatron tiny Llama, against responses whose rollout log-probs are
    the model's own plus a known offset per token: the mean |Δ| is that offset's mean; no top-k metrics."""
    import torch

    from qurl_mcore.megatron.logprobs import token_logprobs
    from qurl_mcore.models.tiny import tiny_checkpoint
    from qurl_mcore.rollout.results import Generation

    path = str(tiny_checkpoint("llama"))
    assert not align.is_moe(path) and align.is_moe(str(align.default_model()))
    with align.megatron_ready():
        model = align.training_model("bf16", path)
        gens, offsets = [], []
        for prompt, response in (([1, 5, 9], [7, 3, 2, 8]), ([4, 4], [6, 1])):
            with torch.no_grad():
                own = token_logprobs(model, torch.tensor([prompt + response])).logprobs[0, len(prompt):]
            off = torch.arange(1, len(response) + 1, dtype=torch.float64) / 100
            offsets.append(off)
            gens.append(Generation(prompt, response, (own.double() - off).tolist(), None, "", None, None))
        with pytest.raises(ValueError, match="needs an MoE"):
            align.paired(model, gens, replay=True)
        pairs = align.paired(model, gens)
    assert set(pairs) == {"train_logprobs", "rollout_logprobs"}
    row = align.metrics(pairs)
    assert row["tokens"] == 6 and row["topk_match_frac"] is None and row["topk_match_by_layer"] is None
    assert row["mean_abs_logprob_diff"] == pytest.approx(float(torch.cat(offsets).mean()), abs=1e-6)


def _row(precision, **metrics):
    p = PRECISIONS[precision]
    return {"precision": precision, "rollout": p.rollout or "bf16", "training": p.train, "tokens": 96,
            "scope": "experts", "fmt": "nvfp4", **metrics}


def test_format_table():
    rows = [_row("bf16", pcc=1.0, topk_match_frac=1.0, topk_overlap_mean=1.0, mean_abs_logprob_diff=0.0),
            _row("fp4_rc", pcc=0.99987654, topk_match_frac=0.96875, topk_overlap_mean=0.984375,
                 mean_abs_logprob_diff=0.00123)]
    lines = align.format_table(rows).splitlines()
    assert lines[0] == "| precision | rollout | training | tokens | PCC | top-k match | top-k overlap | mean |Δ logp| |"
    assert lines[1] == "|---|---|---|---|---|---|---|---|"
    assert lines[2] == "| bf16 | bf16 | bf16 | 96 | 1.0000 | 1.0000 | 1.0000 | 0.0000 |"
    assert lines[3] == "| fp4_rc | qurl_fp4_rc | rc_both | 96 | 0.9999 | 0.9688 | 0.9844 | 0.0012 |"
    assert lines[-1] == "scope experts, FP4 format nvfp4"
    dense = align.format_table([_row("fp4", pcc=0.5, topk_match_frac=None, topk_overlap_mean=None,
                                     mean_abs_logprob_diff=0.25)]).splitlines()
    assert dense[2] == "| fp4 | qurl_fp4 | rc_none | 96 | 0.5000 | — | — | 0.2500 |"
    with pytest.raises(ValueError, match="lacks"):
        align.format_table([_row("fp4", pcc=1.0)])
    with pytest.raises(ValueError, match="no rows"):
        align.format_table([])


def test_cli_rejects_an_unknown_precision(capsys):
    assert main(["align", "--precisions", "bf16,fp4_rc", "nope"]) == 2
    out = capsys.readouterr().out
    assert "qurl align: unknown precision 'nope'" in out


def test_dense_first_layers_are_left_out_of_the_routing_comparison():
    """tiny-glm4_moe: layer 1 is dense, so the engine's row for it (every layer is reported, here filled with
    -1) has no trainer counterpart; the MoE layers' rows, the trainer's own routes, match exactly."""
    import numpy as np
    import torch

    from qurl_mcore.megatron.logprobs import token_logprobs
    from qurl_mcore.models.tiny import tiny_checkpoint
    from qurl_mcore.rollout.results import Generation

    path = tiny_checkpoint("glm4_moe")
    hf = json.loads((path / "config.json").read_text())
    dense = hf["first_k_dense_replace"]
    assert dense >= 1 and hf["num_hidden_layers"] > dense
    with align.megatron_ready():
        model = align.training_model("bf16", str(path))
        prompt, response = [1, 5, 9], [7, 3, 2, 8]
        with torch.no_grad():
            own = token_logprobs(model, torch.tensor([prompt + response]), return_routed_experts=True)
        moe_routes = own.routed_experts[:, 0, :-1].transpose(0, 1)  # [forwarded tokens, moe layers, k]
        rows = -np.ones((moe_routes.shape[0], hf["num_hidden_layers"], moe_routes.shape[2]), dtype=np.int32)
        rows[:, dense:] = moe_routes.numpy()
        gen = Generation(prompt, response, own.logprobs[0, len(prompt):].double().tolist(), None, "", None, None,
                         routed_experts=rows)
        pairs = align.paired(model, [gen])
    row = align.metrics(pairs)
    assert pairs["rollout_experts"].shape == (len(response), hf["num_hidden_layers"] - dense, moe_routes.shape[2])
    assert row["topk_match_frac"] == 1.0 and len(row["topk_match_by_layer"]) == hf["num_hidden_layers"] - dense
