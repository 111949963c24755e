"""A rendered job run by a real Slurm (a one-node cluster on this machine, launch/slurm/local_cluster.sh):
Ray head on the node, readiness wait, the entry command, and its exit state."""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qurl_mcore.slurm import SlurmJob, submit

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


def _wait_for(job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        fields = dict(re.findall(r"(\w+)=(\S+)", info))
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            pytest.fail(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
        time.sleep(2)


def _job(tmp_path, name, command):
    venv = Path(sys.executable).parent.parent
    return SlurmJob(nodes=1, gpus_per_node=0, cpus_per_node=2, config="unused.yaml", workdir=str(ROOT),
                    venv=str(venv), job_name=name, log_dir=str(tmp_path / "logs"), ckpt_dir=str(tmp_path / "ckpt"),
                    object_store_bytes=256 * 2**20, command=command)


PROBE = ("python -c 'import ray; ray.init(); r = ray.cluster_resources(); "
         "print(\"RESOURCES\", int(r[\"qurl_train\"]), int(r[\"qurl_rollout\"]), int(r[\"CPU\"]))'")


def test_job_runs_ray_and_the_entry_point_to_completion(slurm, tmp_path):
    script, job_id = submit(_job(tmp_path, "qurl-smoke", PROBE))
    fields = _wait_for(job_id)
    log = (tmp_path / "logs" / f"qurl-smoke-{job_id}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log
    assert "[ray] 1/1 nodes up" in log
    assert "RESOURCES 1 1 2" in log  # colocated: the node both trains and rolls out
    assert "training exited with status 0" in log
    assert (tmp_path / "ckpt").is_dir()
    assert script.read_text().startswith("#!/bin/bash")


def test_entry_point_failure_fails_the_job(slurm, tmp_path):
    _, job_id = submit(_job(tmp_path, "qurl-fail", "python -c 'import sys; sys.exit(3)'"))
    fields = _wait_for(job_id)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "3:0"


# A stand-in for the trainer's side of the contract the job script relies on: checkpoint on SIGTERM, resume from
# the checkpoint directory on start. What is under test is the job script's signal and requeue handling.
TRAINER = """
import os, pathlib, signal, sys, time
ckpt, total = pathlib.Path(sys.argv[1]), int(sys.argv[2])
state = ckpt / "step"
step = int(state.read_text()) if state.exists() else 0
print(f"TRAINER start {step} restart {os.environ.get('SLURM_RESTART_COUNT', '0')}", flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
while step < total and not stop:
    time.sleep(1)
    step += 1
    print(f"TRAINER step {step}", flush=True)
(ckpt / "step.tmp").write_text(str(step))
(ckpt / "step.tmp").rename(state)
print(f"TRAINER saved {step}", flush=True)
"""


def test_time_limit_signal_checkpoints_requeues_and_resumes(slurm, tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    job = _job(tmp_path, "qurl-requeue", f"python {trainer} {tmp_path / 'ckpt'} 12")
    _, job_id = submit(job)
    log = tmp_path / "logs" / f"qurl-requeue-{job_id}.out"
    deadline = time.monotonic() + 180
    while not (log.exists() and "TRAINER step 3" in log.read_text()):
        assert time.monotonic() < deadline, "the trainer never started"
        time.sleep(1)
    # what Slurm sends --signal's grace period before the time limit
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    fields = _wait_for(job_id, timeout=420)  # Slurm holds a requeued job back for about two minutes
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", text
    saved = int(re.search(r"TRAINER saved (\d+)", text).group(1))
    assert 3 <= saved < 12
    assert text.index(f"TRAINER saved {saved}") < text.index("requeueing job")  # checkpoint before requeue
    assert f"TRAINER start {saved} restart 1" in text  # resumed where it stopped
    assert "TRAINER saved 12" in text
