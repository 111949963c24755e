"""A rendered job run by a real Slurm (a one-node cluster on this machine, launch/slurm/local_cluster.sh):
Ray head on the node, readiness wait, the entry command and its exit state. The time-limit signal, checkpoint,
requeue and resume of a real training run: test_slurm_multinode.py, the same job script across two nodes."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from qurl_mcore.slurm import SlurmJob, submit

pytestmark = [pytest.mark.slow,  # real engines, process groups or Slurm jobs: `make test`, not test-fast
              pytest.mark.machine]  # this machine's one Slurm controller

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "launch" / "slurm" / "local_cluster.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The one-node cluster, in a state directory of its own: a directory an earlier session's cluster left (a
    machine reused, its cluster killed mid-job) would bring back that job as running, holding the node."""
    if shutil.which("sbatch") is None and os.geteuid() != 0:
        pytest.skip("needs Slurm installed, or root to install Debian's slurmctld/slurmd/munge")
    state = Path(tempfile.mkdtemp(prefix="qurl-slurm-"))  # short: slurmstepd's sockets live there
    try:
        started = subprocess.run(["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True,
                                 timeout=600)
        if started.returncode and "belongs to another Slurm cluster" in started.stderr:
            pytest.skip(started.stderr.strip())
        assert started.returncode == 0, started.stdout + started.stderr
        yield state
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], capture_output=True, timeout=120)
        if (state / "log").is_dir():
            shutil.copytree(state / "log", tmp_path_factory.mktemp("slurm-log"), dirs_exist_ok=True)
        shutil.rmtree(state, ignore_errors=True)


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


def slurm_logs(state: Path, lines: int = 15) -> str:
    """The last lines of each of the cluster's daemon logs, for a failure message."""
    return "".join(f"\n==> {f.name}\n" + "\n".join(f.read_text().splitlines()[-lines:])
                   for f in sorted((state / "log").glob("*.log")))


def _wait_for(job_id: str, state: Path, timeout: float = 300, pending_s: float = 90) -> dict:
    """Until the job ends; fails with Slurm's reason and logs when it has not ended within `timeout`, or is still
    pending after `pending_s` (a job on an idle node of its own starts within seconds)."""
    start = time.monotonic()
    while True:
        fields = _job_fields(job_id)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        waited = time.monotonic() - start
        if waited > timeout or (fields.get("JobState") == "PENDING" and waited > pending_s):
            nodes = subprocess.run(["sinfo", "-N", "-o", "%N %T %E"], capture_output=True, text=True).stdout
            pytest.fail(f"job {job_id} still {fields.get('JobState')} ({fields.get('Reason')}) after {waited:.0f} s"
                        f"\nnodes:\n{nodes}{slurm_logs(state)}")
        time.sleep(2)


def _job(tmp_path, name, command=None, config="unused.yaml", overrides=()):
    venv = Path(sys.executable).parent.parent
    return SlurmJob(nodes=1, gpus_per_node=0, cpus_per_node=2, config=config, overrides=list(overrides),
                    workdir=str(ROOT), venv=str(venv), job_name=name, log_dir=str(tmp_path / "logs"),
                    ckpt_dir=str(tmp_path / "ckpt"), object_store_bytes=256 * 2**20, command=command)


PROBE = ("python -c 'import ray; ray.init(); r = ray.cluster_resources(); "
         "print(\"RESOURCES\", int(r[\"qurl_train\"]), int(r[\"qurl_rollout\"]), int(r[\"CPU\"]))'")


def test_job_runs_ray_and_the_entry_point_to_completion(slurm, sbatch, tmp_path):
    script, job_id = sbatch(_job(tmp_path, "qurl-smoke", PROBE))
    fields = _wait_for(job_id, slurm)
    log = (tmp_path / "logs" / f"qurl-smoke-{job_id}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log
    assert "[ray] 1/1 nodes up" in log
    assert "RESOURCES 1 1 2" in log  # colocated: the node both trains and rolls out
    assert "training exited with status 0" in log
    assert (tmp_path / "ckpt").is_dir()
    assert script.read_text().startswith("#!/bin/bash")


def test_entry_point_failure_fails_the_job(slurm, sbatch, tmp_path):
    _, job_id = sbatch(_job(tmp_path, "qurl-fail", "python -c 'import sys; sys.exit(3)'"))
    fields = _wait_for(job_id, slurm)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "3:0"


def test_a_state_dir_too_long_for_slurmstepds_sockets_is_refused(slurm, tmp_path):
    """slurmstepd's Unix sockets live in the state directory: a path past the kernel's 107 characters would make
    every job fail at launch and requeue without end, so the cluster does not start there."""
    state = tmp_path / ("s" * 90)
    out = subprocess.run(["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "too long for slurmstepd's sockets" in out.stderr, out.stderr
    assert "use a shorter STATE_DIR" in out.stderr and not state.exists()


def test_a_second_cluster_on_the_taken_port_is_refused_and_the_first_keeps_working(slurm, sbatch, tmp_path):
    """Another STATE_DIR's controller on the port would answer for the new cluster with its own jobs (an earlier
    session's, say): the start is refused before anything is written, and the running cluster is untouched."""
    other = Path(tempfile.mkdtemp(prefix="qurl-slurm-"))
    try:
        out = subprocess.run(["bash", str(CLUSTER), "start", str(other)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "port 6817 is taken" in out.stderr, out.stderr
        assert not (other / "ctld").exists()
        assert f"StateSaveLocation={slurm}/ctld" in Path("/etc/slurm/slurm.conf").read_text()
    finally:
        shutil.rmtree(other, ignore_errors=True)
    _, job_id = sbatch(_job(tmp_path, "qurl-after", "true"))
    assert _wait_for(job_id, slurm)["JobState"] == "COMPLETED"
