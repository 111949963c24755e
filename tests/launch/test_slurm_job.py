"""A rendered job run by a real Slurm (a one-node cluster on this machine, launch/slurm/local_cluster.sh):
Ray head on the node, readiness wait, the entry command and its exit state. The time-limit signal, checkpoint,
requeue and resume of a real training run: test_slurm_multinode.py, the same job script across two nodes."""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qurl_mcore.slurm import SlurmJob, submit

pytestmark = [pytest.mark.slow,  # real engines, process groups or Slurm jobs: `make test`, not test-fast
              pytest.mark.machine]  # this machine's one Slurm controller

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
    yield
    subprocess.run(["bash", str(ROOT / "launch/slurm/local_cluster.sh"), "stop"], capture_output=True, timeout=120)


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


def _wait_for(job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        fields = _job_fields(job_id)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} still {fields.get('JobState')} after {timeout} s")
        time.sleep(2)


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


def test_a_state_dir_too_long_for_slurmstepds_sockets_is_refused(slurm, tmp_path):
    """slurmstepd's Unix sockets live in the state directory: a path past the kernel's 107 characters would make
    every job fail at launch and requeue without end, so the cluster does not start there."""
    state = tmp_path / ("s" * 90)
    out = subprocess.run(["bash", str(ROOT / "launch/slurm/local_cluster.sh"), "start", str(state)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "too long for slurmstepd's sockets" in out.stderr, out.stderr
    assert "use a shorter STATE_DIR" in out.stderr and not state.exists()
