"""`qurl train` end to end on tiny models: a local Ray cluster, real Megatron trainer actors, real SGLang HTTP
engines on CPU with the qurl quantization plugin, weights pushed back every step.

The resume test needs rollouts that do not depend on the engine's sampler state (SGLang's per-request seeds
need its deterministic mode, which the CPU attention backend lacks): greedy decoding (top_k=1), with an entropy
bonus so that every step still changes the weights and the optimizer state matters.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qurl_mcore.checkpoint import latest_checkpoint, model_tensors, read_meta
from qurl_mcore.loop.report import PANELS

TINY = ["data.prompts_per_step=2", "data.num_prompts=16", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=6", "rollout.context_length=256", "rollout.max_total_tokens=2048",
        "train.micro_batch_size=4", "train.lr=1e-4", "logging.progress=false", "checkpoint.every=1",
        "train.threads=2"]
GREEDY = ["rollout.top_k=1", "train.entropy_coef=0.01"]
KEYS = ("reward/mean", "loss/policy", "mismatch/kl_k3", "mismatch/abs_logprob_diff", "clip_frac/high",
        "is_ratio/mean", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "time/rollout", "time/push",
        "time/train_step", "train/grad_norm", "rollout/engine_restarts")


def _command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "qurl_mcore", "train", f"checkpoint.dir={run_dir}/ckpt",
            f"logging.dir={run_dir}/logs", *TINY, *overrides]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen(_command(run_dir, *overrides), stdout=open(run_dir / "out.log", "ab"),
                            stderr=subprocess.STDOUT, env=env)


def _train(run_dir: Path, *overrides: str, timeout: float = 600) -> str:
    process = _start(run_dir, *overrides)
    code = process.wait(timeout=timeout)
    out = (run_dir / "out.log").read_text()
    assert code == 0, out[-4000:]
    return out


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(run_dir: Path, process: subprocess.Popen, step: int, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while len(_metrics(run_dir)) < step:
        assert process.poll() is None, (run_dir / "out.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.5)


def _model_state(run_dir: Path) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(run_dir / "ckpt")
    return read_meta(path)["step"], model_tensors(path)


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """Tiny Llama, INT8 rollout, ACR, UAQ: three uninterrupted steps."""
    run_dir = tmp_path_factory.mktemp("dense")
    _train(run_dir, "model.path=tiny-llama", "steps=3", *GREEDY)
    return run_dir


@pytest.mark.slow
def test_dense_loop_logs_every_metric_checkpoints_and_reports(dense_run):
    records = _metrics(dense_run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in KEYS:
        assert all(key in r for r in records), key
    assert all(r["train/skipped_nonfinite"] == 0 and r["train/skipped_no_signal"] == 0 for r in records)
    assert all(r["uaq/update_capture"] > 0 for r in records)  # every step moved some INT8 codes
    assert records[0]["mismatch/abs_logprob_diff"] > 0  # INT8 rollout vs full-precision trainer
    assert (dense_run / "logs" / "report.html").is_file()
    # held-out eval is off here (test_eval.py), and a dense model has no routing to compare
    plotted = {name for _, names in PANELS for name in names if not name.startswith(("eval/", "mismatch/topk"))}
    assert plotted <= set(records[0]), plotted - set(records[0])  # the report plots metrics the loop logs
    assert list((dense_run / "logs" / "tensorboard").iterdir())
    names = sorted(p.name for p in (dense_run / "ckpt").iterdir())
    assert names == ["hf", "step_00000002", "step_00000003"]  # keep=2, and the final model for transformers
    assert (dense_run / "ckpt" / "hf" / "model.safetensors.index.json").is_file()
    from qurl_mcore.provenance import code_version

    # the run names the code that made it (its first line)
    assert f"; code {code_version().label()}; logs in" in (dense_run / "out.log").read_text()


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_equals_the_uninterrupted_run(dense_run, tmp_path):
    """Both parts write their checkpoints in the background (checkpoint.async_save): the stop waits for its
    checkpoint, the resumed run publishes each one during the next step's rollout and the last at its end."""
    process = _start(tmp_path, "model.path=tiny-llama", "steps=3", "checkpoint.async_save=true", *GREEDY)
    _wait_for_step(tmp_path, process, 1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 75  # EXIT_STOPPED: checkpoint written, run the same command to resume
    out = (tmp_path / "out.log").read_text()
    stopped_at, _ = _model_state(tmp_path)
    assert "SIGTERM at step" in out and stopped_at < 3, out[-3000:]
    _train(tmp_path, "model.path=tiny-llama", "steps=3", "checkpoint.async_save=true", *GREEDY)
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3]
    step, resumed = _model_state(tmp_path)
    ref_step, reference = _model_state(dense_run)
    assert step == ref_step == 3
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
    for got, want in zip(_metrics(tmp_path), _metrics(dense_run)):
        assert got["loss/total"] == want["loss/total"]


def _assert_same_two_steps(run: Path, reference: Path) -> None:
    """Greedy rollouts that agree token for token (so the engines served the same weights), the same losses,
    and bitwise the same weights after step 2."""
    got, want = _metrics(run), _metrics(reference)[:2]
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(got, want):
        for key in ("reward/mean", "mismatch/abs_logprob_diff", "loss/total"):
            assert a[key] == b[key], key
    mine, theirs = (model_tensors(r / "ckpt" / "step_00000002") for r in (run, reference))
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(mine[name], value), name


@pytest.mark.slow
def test_disaggregated_across_two_nodes_matches_the_one_node_run(dense_run, netns_nodes, tmp_path):
    """The trainer on one host and the engine on another (network namespaces: each its own address, TCP only
    between them): Ray spans both, the engine listens on its node's address and takes the weights by gloo
    broadcast from the trainer's node, and the run is the one-node run number for number. (This found that
    gloo advertised the address the host name resolves to, a loopback, so no group formed across nodes:
    `transfer.bind_gloo_towards`.) The one-node disaggregated layout is this run with both nodes' tags on one."""
    nodes = netns_nodes(2)
    head = nodes.start_ray({1: '{"qurl_train": 1}', 2: '{"qurl_rollout": 1}'}, tmp_path)
    command = _command(tmp_path, "model.path=tiny-llama", "steps=2", "layout=disaggregated", *GREEDY)
    command[4:4] = ["--address", head]  # qurl train --address HEAD overrides...
    done = nodes.run(1, *command, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"weights go to the engines by gloo broadcast (group at {nodes.addr(1)}:" in out
    _assert_same_two_steps(tmp_path, dense_run)


@pytest.mark.slow
def test_a_killed_engine_is_replaced_and_a_killed_trainer_ends_the_run_naming_it(tmp_path):
    """With rollout.offload (engines release their memory while the trainer steps, as on GPUs): the engine
    killed after step 1 is restarted, the push resumes only the memory the others released, and the run goes on.
    Then the trainer, killed after step 3's checkpoint, ends the run with one message that names it (and does not
    blame an engine), keeping that checkpoint for the resume. (One run for both: a run's start-up is most of it.)"""
    process = _start(tmp_path, "model.path=tiny-llama", "steps=6", "rollout.offload=true")
    _wait_for_step(tmp_path, process, 1)
    pid = json.loads((tmp_path / "logs" / "pids.json").read_text())["engines"][0]
    os.killpg(pid, signal.SIGKILL)  # the server and its scheduler/detokenizer workers
    _wait_for_step(tmp_path, process, 3)
    records = _metrics(tmp_path)
    assert [r["step"] for r in records[:3]] == [1, 2, 3]
    assert records[0]["rollout/engine_restarts"] == 0 and records[2]["rollout/engine_restarts"] == 1
    pids = json.loads((tmp_path / "logs" / "pids.json").read_text())
    assert pids["engines"][0] != pid
    deadline = time.monotonic() + 120
    # step 3's checkpoint follows its metrics (latest_checkpoint reads every file of it: once a poll)
    while (path := latest_checkpoint(tmp_path / "ckpt")) is None or read_meta(path)["step"] < 3:
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.5)
    before = len((tmp_path / "out.log").read_text())
    os.kill(pids["trainers"][0], signal.SIGKILL)
    assert process.wait(timeout=300) == 1  # EXIT_FAILED
    out = (tmp_path / "out.log").read_text()[before:]
    assert "trainer rank 0 failed" in out and "resume from the last checkpoint" in out, out[-3000:]
    assert "restarting" not in out and "Traceback" not in out, out[-3000:]  # not blamed on an engine
    assert read_meta(latest_checkpoint(tmp_path / "ckpt"))["step"] >= 3  # kept for the resume


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_resumes_from_the_one_before(dense_run, tmp_path):
    """The dense run keeps steps 2 and 3. Step 3's slice file of rank 0 truncated (a full disk): the resume names it,
    takes step 2 instead, redoes step 3, and ends with the uninterrupted run's weights, bit for bit."""
    import shutil

    shutil.copytree(dense_run / "ckpt", tmp_path / "ckpt")
    shutil.copytree(dense_run / "logs", tmp_path / "logs", ignore=shutil.ignore_patterns("tensorboard"))
    rank0 = tmp_path / "ckpt" / "step_00000003" / "trainer" / "__0_0.distcp"
    rank0.write_bytes(rank0.read_bytes()[:1000])
    out = _train(tmp_path, "model.path=tiny-llama", "steps=3", *GREEDY)
    assert "step_00000003 is damaged (trainer/__0_0.distcp has 1000 bytes" in out, out[-3000:]
    assert "resuming at step 2" in out, out[-3000:]
    step, resumed = _model_state(tmp_path)
    _, reference = _model_state(dense_run)
    assert step == 3 and all(torch.equal(resumed[n], reference[n]) for n in reference)


@pytest.mark.slow
def test_moe_loop_with_fp4_rc_on_both_sides_and_routing_replay(tmp_path):
    """MoEResQ's symmetric setting: FP4 RC experts in the trainer (Megatron) and the engine (SGLang), with the
    engine's routing replayed in the trainer (R3); the routing agreement measured before replay every step."""
    _train(tmp_path, "model.path=tiny-qwen3_moe", "steps=2", "precision=fp4_rc", "scope=experts",
           "uaq.enabled=false", "train.routing_replay=r3")
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/skipped_nonfinite"] == 0 and r["mismatch/prob_pearson"] > 0.9 for r in records)
    for r in records:  # the tiny MoE has 2 MoE layers; symmetric RC keeps most routes (docs/align.md)
        layers = [r[f"mismatch/topk_match/layer{n}"] for n in (1, 2)]
        assert 0.5 < r["mismatch/topk_match"] <= r["mismatch/topk_overlap"] <= 1
        assert r["mismatch/topk_match"] == pytest.approx(sum(layers) / 2)


@pytest.mark.slow
@pytest.mark.parametrize("precision,uaq,replay", [("bf16", "false", "r3"), ("int8", "true", "none")])
def test_mixtral_loop(tmp_path, precision, uaq, replay):
    """Two steps on tiny-mixtral: unquantized, SGLang's FusedMoE Mixtral reports its routing and the trainer
    replays it; quantized (with UAQ), SGLang's QuantMixtralForCausalLM (a linear per expert projection) takes
    the pushes."""
    _train(tmp_path, "model.path=tiny-mixtral", "steps=2", f"precision={precision}", f"uaq.enabled={uaq}",
           f"train.routing_replay={replay}")
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/skipped_nonfinite"] == 0 and r["mismatch/prob_pearson"] > 0.9 for r in records)
    if replay == "r3":
        assert all(0.5 < r["mismatch/topk_match"] <= r["mismatch/topk_overlap"] <= 1 for r in records)


@pytest.mark.slow
def test_glm4_moe_loop(tmp_path):
    """Two steps on tiny-glm4_moe (a dense first layer, then a sigmoid router with an expert bias and a shared
    expert): FP4 RC experts on both sides with the engine's routing replayed (R3). tiny-deepseek_v3's loop cannot
    run: SGLang 0.5.23's CPU engine cannot run MLA's attention without AMX (docs/models.md); its trainer,
    converter and router replay are tested in tests/megatron."""
    _train(tmp_path, "model.path=tiny-glm4_moe", "steps=2", "precision=fp4_rc", "scope=experts",
           "uaq.enabled=false", "train.routing_replay=r3")
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["train/skipped_nonfinite"] == 0 and r["mismatch/prob_pearson"] > 0.9 for r in records)
    assert all(0.5 < r["mismatch/topk_match"] <= r["mismatch/topk_overlap"] <= 1 for r in records)


def test_bad_config_lists_every_problem_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("precision: int4\nrollout: {samples_per_prompt: 1}\ntrain: {lr: -1, los: acr}\n")
    out = subprocess.run([sys.executable, "-m", "qurl_mcore", "train", "--config", str(bad),
                          f"logging.dir={tmp_path}/logs"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    for problem in ("precision: 'int4' is not one of", "train.lr: must be in (0, 1]",
                    "train.los: unknown field (did you mean train.loss?)"):
        assert problem in out.stderr, out.stderr
    assert not (tmp_path / "logs").exists()
