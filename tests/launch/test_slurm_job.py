"""A rendered job run by a real Slurm (a one-node cluster on this machine, launch/slurm/local_cluster.sh):
Ray head on the node, readiness wait, the entry command, its exit state, and the CPU demo (`qurl train` on
launch/configs/cpu_demo.yaml, cut to three small steps) checkpointing on the time-limit signal, requeueing and
resuming to completion."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qurl_mcore.loop.checkpoint import latest_checkpoint, read_meta
from qurl_mcore.slurm import SlurmJob, submit

pytestmark = pytest.mark.slow  # real engines, process groups or Slurm jobs: `make test`, not test-fast

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("sbatch") is None and os.geteuid() != 0:
        pytest.skip("needs Slurm installed, or root to install Debian's slurmctld/slurmd/munge")
    started = subprocess.run(["bash", str(ROOT / "launch/slurm/local_cluster.sh"), "start"],
                             capture_output=True, text=True, timeout=600)
    if started.returncode and "belongs to another Slurm cluster" in started.stderr:
        pytest.skip(started.stderr.strip())
    assert started.returncode == 0, started.stdout + started.stderr


@pytest.fixture
def sbatch(slurm):
    """`submit`, cancelling the job when the test ends: a failed test must not leave it holding the node."""
    ids = []

    def go(job: SlurmJob) -> tuple[Path, str]:
        script, job_id = submit(job)
        ids.append(job_id)
        return script, job_id

    yield go
    for job_id in ids:
        subprocess.run(["scancel", job_id], capture_output=True)


def _job_fields(job_id: str) -> dict:
    info = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", info))


def _wait_for_checkpoint(ckpt: Path, log: Path, timeout: float = 600) -> None:
    """Until the job's run has written its first checkpoint (step 1 done and saved); fails at once if the
    training step exited."""
    deadline = time.monotonic() + timeout
    while latest_checkpoint(ckpt) is None:
        text = log.read_text() if log.exists() else ""
        assert "training exited" not in text, text[-4000:]
        assert time.monotonic() < deadline, f"no checkpoint within {timeout:.0f} s:\n" + text[-4000:]
        time.sleep(1)


def _requeued_once_to_completion(job_id: str, ckpt: Path, log: Path) -> str:
    """Once the run's first checkpoint is written, signal the job as Slurm does its --signal grace period before
    the time limit; the job must requeue once and complete. Returns its log."""
    _wait_for_checkpoint(ckpt, log)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    _release_when_requeued(job_id)
    fields = _wait_for(job_id, timeout=600)
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0" and fields["Restarts"] == "1", text
    return text


def _wait_for(job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        fields = _job_fields(job_id)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
        time.sleep(2)


def _release_when_requeued(job_id: str, timeout: float = 300) -> None:
    """Slurm holds a requeued job back for about two minutes (its BeginTime); start it now instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = _job_fields(job_id)
        if fields.get("Restarts") == "1" and fields.get("JobState") == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
            return
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
            return  # never requeued: the assertions that follow say why
        time.sleep(1)
    pytest.fail(f"job {job_id} was not requeued within {timeout} s")


def _job(tmp_path, name, command=None, config="unused.yaml", overrides=()):
    venv = Path(sys.executable).parent.parent
    return SlurmJob(nodes=1, gpus_per_node=0, cpus_per_node=2, config=config, overrides=list(overrides),
                    workdir=str(ROOT), venv=str(venv), job_name=name, log_dir=str(tmp_path / "logs"),
                    ckpt_dir=str(tmp_path / "ckpt"), object_store_bytes=256 * 2**20, command=command)


PROBE = ("python -c 'import ray; ray.init(); r = ray.cluster_resources(); "
         "print(\"RESOURCES\", int(r[\"qurl_train\"]), int(r[\"qurl_rollout\"]), int(r[\"CPU\"]))'")


def test_job_runs_ray_and_the_entry_point_to_completion(sbatch, tmp_path):
    script, job_id = sbatch(_job(tmp_path, "qurl-smoke", PROBE))
    fields = _wait_for(job_id)
    log = (tmp_path / "logs" / f"qurl-smoke-{job_id}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log
    assert "[ray] 1/1 nodes up" in log
    assert "RESOURCES 1 1 2" in log  # colocated: the node both trains and rolls out
    assert "training exited with status 0" in log
    assert (tmp_path / "ckpt").is_dir()
    assert script.read_text().startswith("#!/bin/bash")


def test_entry_point_failure_fails_the_job(sbatch, tmp_path):
    _, job_id = sbatch(_job(tmp_path, "qurl-fail", "python -c 'import sys; sys.exit(3)'"))
    fields = _wait_for(job_id)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "3:0"


# The CPU demo, cut to three small steps so that the job fits in CI; everything else is the shipped config.
DEMO_STEPS = 3
DEMO = [f"steps={DEMO_STEPS}", "data.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
        "rollout.max_total_tokens=2048", "train.micro_batch_size=4", "train.threads=2", "checkpoint.every=1",
        "logging.progress=false", "eval.every=0"]  # the held-out evaluation: tests/loop/test_eval.py


def test_cpu_demo_checkpoints_on_the_time_limit_signal_requeues_and_resumes(sbatch, tmp_path):
    ckpt = tmp_path / "ckpt"
    job = _job(tmp_path, "qurl-demo", config=str(ROOT / "launch/configs/cpu_demo.yaml"),
               overrides=[*DEMO, f"logging.dir={tmp_path / 'run'}"])
    script, job_id = sbatch(job)
    assert f"checkpoint.dir={ckpt}" in script.read_text()  # the rendered command, not one written for the test
    log = tmp_path / "logs" / f"qurl-demo-{job_id}.out"
    text = _requeued_once_to_completion(job_id, ckpt, log)
    stopped = int(re.search(r"SIGTERM at step (\d+): checkpoint written", text).group(1))
    assert "training exited with status 75" in text  # EXIT_STOPPED, which the job turns into a requeue
    assert 1 <= stopped < DEMO_STEPS, text
    assert text.index("checkpoint written") < text.index("requeueing job")  # checkpoint before requeue
    assert f"resuming at step {stopped} from {ckpt}" in text  # the requeued start continued from it
    final = latest_checkpoint(ckpt)  # the newest checkpoint that verifies against its checksums
    assert read_meta(final)["step"] == DEMO_STEPS and (final / "rank0.pt").stat().st_size > 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, DEMO_STEPS + 1))
