"""`qurl train` end to end on tiny models: a local Ray cluster, real Megatron trainer actors, real SGLang HTTP
engines on CPU with the qurl quantization plugin, weights pushed back every step. Here: the dense run and what
is compared with it (its resume after a SIGTERM and after a damaged checkpoint, the same run across two nodes);
the MoE architectures' loops are in test_e2e_moe.py, killed processes in test_e2e_faults.py.

The resume test needs rollouts that do not depend on the engine's sampler state (SGLang's per-request seeds
need its deterministic mode, which the CPU attention backend lacks): greedy decoding (top_k=1), with an entropy
bonus so that every step still changes the weights and the optimizer state matters.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qurl_mcore.checkpoint import model_tensors
from qurl_mcore.loop.report import PANELS
from tests.loop.runs import GREEDY, assert_code_pushes, command, metrics, model_state, start, train, wait_for_step

KEYS = ("reward/mean", "loss/policy", "mismatch/kl_k3", "mismatch/abs_logprob_diff", "clip_frac/high",
        "is_ratio/mean", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "time/rollout", "time/push",
        "push/bytes", "push/verified_units", "time/train_step", "train/grad_norm", "rollout/engine_restarts")


#: code pushes where they serve, which is every run here: the one-node runs push the trainer's INT8 codes by tensor,
#: the disaggregated run broadcasts them
PUSH = "rollout.push=auto"


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """Tiny Llama, INT8 rollout (code pushes), ACR, UAQ: three uninterrupted steps."""
    run_dir = tmp_path_factory.mktemp("dense")
    train(run_dir, "model.path=tiny-llama", "steps=3", PUSH, *GREEDY)
    return run_dir


@pytest.mark.slow
def test_dense_loop_logs_every_metric_checkpoints_and_reports(dense_run):
    records = metrics(dense_run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in KEYS:
        assert all(key in r for r in records), key
    assert all(r["train/skipped_nonfinite"] == 0 and r["train/skipped_no_signal"] == 0 for r in records)
    assert all(r["uaq/update_capture"] > 0 for r in records)  # every step moved some INT8 codes
    assert_code_pushes(dense_run, "model.path=tiny-llama", PUSH, *GREEDY)
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
    """The SIGTERM goes to the run's whole process group, Ray's daemons and workers included, as Slurm and
    `timeout` send it: the run still checkpoints (Ray's processes ignore it) and exits 75. Both parts write their
    checkpoints in the background (checkpoint.async_save): the stop waits for its checkpoint, the resumed run
    publishes each one during the next step's rollout and the last at its end."""
    # the step in progress gets all the time it needs to end and be checkpointed (on this loaded machine a step
    # may take longer than the default checkpoint.stop_grace_s, after which the run would exit without it)
    process = start(tmp_path, "model.path=tiny-llama", "steps=3", "checkpoint.async_save=true",
                    "checkpoint.stop_grace_s=600", PUSH, *GREEDY, own_group=True)
    wait_for_step(tmp_path, process, 1)
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=300) == 75  # EXIT_STOPPED: checkpoint written, run the same command to resume
    out = (tmp_path / "out.log").read_text()
    stopped_at, _ = model_state(tmp_path)
    assert "SIGTERM at step" in out and stopped_at < 3, out[-3000:]
    train(tmp_path, "model.path=tiny-llama", "steps=3", "checkpoint.async_save=true", PUSH, *GREEDY)
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]
    # the resumed run's code pushes passed the refit check every step
    assert_code_pushes(tmp_path, "model.path=tiny-llama", PUSH, *GREEDY)
    step, resumed = model_state(tmp_path)
    ref_step, reference = model_state(dense_run)
    assert step == ref_step == 3
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
    for got, want in zip(metrics(tmp_path), metrics(dense_run)):
        assert got["loss/total"] == want["loss/total"]


def _assert_same_two_steps(run: Path, reference: Path) -> None:
    """Greedy rollouts that agree token for token (so the engines served the same weights), the same losses,
    and bitwise the same weights after step 2."""
    got, want = metrics(run), metrics(reference)[:2]
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
    `transfer.bind_gloo_towards`.) Both push the trainer's INT8 codes: by broadcast here, by tensor there. The
    one-node disaggregated layout is this run with both nodes' tags on one."""
    nodes = netns_nodes(2)
    head = nodes.start_ray({1: '{"qurl_train": 1}', 2: '{"qurl_rollout": 1}'}, tmp_path)
    argv = command(tmp_path, "model.path=tiny-llama", "steps=2", "layout=disaggregated", PUSH, *GREEDY)
    argv[4:4] = ["--address", head]  # qurl train --address HEAD overrides...
    done = nodes.run(1, *argv, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"weights go to the engines by gloo broadcast (group at {nodes.addr(1)}:" in out
    # its broadcast carries the same codes as the one-node run's tensor pushes, and the refit check passed each step
    assert_code_pushes(tmp_path, "model.path=tiny-llama", "layout=disaggregated", PUSH, *GREEDY)
    assert [a["push/bytes"] for a in metrics(tmp_path)] == [b["push/bytes"] for b in metrics(dense_run)[:2]]
    _assert_same_two_steps(tmp_path, dense_run)


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_resumes_from_the_one_before(dense_run, tmp_path):
    """The dense run keeps steps 2 and 3. Step 3's slice file of rank 0 truncated (a full disk): the resume names it,
    takes step 2 instead, redoes step 3, and ends with the uninterrupted run's weights, bit for bit."""
    import shutil

    shutil.copytree(dense_run / "ckpt", tmp_path / "ckpt")
    shutil.copytree(dense_run / "logs", tmp_path / "logs", ignore=shutil.ignore_patterns("tensorboard"))
    rank0 = tmp_path / "ckpt" / "step_00000003" / "trainer" / "__0_0.distcp"
    rank0.write_bytes(rank0.read_bytes()[:1000])
    out = train(tmp_path, "model.path=tiny-llama", "steps=3", PUSH, *GREEDY)
    assert "step_00000003 is damaged (trainer/__0_0.distcp has 1000 bytes" in out, out[-3000:]
    assert "resuming at step 2" in out, out[-3000:]
    step, resumed = model_state(tmp_path)
    _, reference = model_state(dense_run)
    assert step == 3 and all(torch.equal(resumed[n], reference[n]) for n in reference)


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
