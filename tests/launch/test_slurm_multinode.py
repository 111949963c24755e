"""The rendered Slurm job across two Slurm nodes: two network namespaces (tests/netns.py), a slurmd in each with
its own node name and address, slurmctld on this machine (launch/slurm/local_cluster.sh --netns). The job of
`qurl launch slurm --nodes 2 --layout disaggregated --rollout-nodes 1` starts the Ray head on node 1 and a worker
on node 2, trains on node 1 and rolls out on node 2 (tiny Llama, eight short steps), gets the time-limit signal after
a checkpoint, requeues itself and resumes to completion. (test_slurm_job.py: the one-node job's success and failure.)"""
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from qurl_mcore.checkpoint import latest_checkpoint, read_meta
from qurl_mcore.slurm import SlurmJob, render, submit
from tests.launch.test_slurm_job import _job_fields, _wait_for, slurm_logs

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "launch" / "slurm" / "local_cluster.sh"
STEPS = 8  # steps take about a second here: room for the signal to arrive mid-run
TINY = [f"steps={STEPS}", "model.path=tiny-llama", "data.prompts_per_step=2", "data.num_prompts=16",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "rollout.context_length=256",
        "rollout.max_total_tokens=2048", "train.micro_batch_size=4", "train.threads=1", "checkpoint.every=1",
        "logging.progress=false", "eval.every=0", "eval.bf16_reference=false"]


def test_a_disaggregated_job_runs_a_disaggregated_training(tmp_path):
    """Its nodes carry qurl_train or qurl_rollout, never both: a colocated run (the config's default) could not be
    placed there, so the job's command sets the layout, and an override that undoes it is refused."""
    config = tmp_path / "train.yaml"
    config.write_text("model:\n  path: smollm2\n")
    job = SlurmJob(nodes=2, gpus_per_node=0, config=str(config), layout="disaggregated", rollout_nodes=1)
    assert re.search(r"qurl train --config \S+ checkpoint\.dir=\S+ logging\.dir=\S+ layout=disaggregated &", render(job))
    with pytest.raises(ValueError, match="drop the layout= override"):
        render(replace(job, overrides=["layout=colocated"]))


@pytest.fixture
def slurm_nodes(netns_nodes, tmp_path, monkeypatch):
    """Two namespace nodes running a Slurm cluster of their own; its daemons are stopped (and then the nodes,
    with everything the jobs left in them, taken down by netns_nodes) however the test ends. The cluster's state
    sits in a short directory of its own: slurmstepd's sockets live there and a Unix socket's path has 107
    characters at most (pytest-xdist's tmp_path is too long); its logs are kept in tmp_path."""
    nodes = netns_nodes(2)
    state = Path(tempfile.mkdtemp(prefix="qurl-slurm-"))
    monkeypatch.setenv("SLURM_CONF", str(state / "slurm.conf"))  # sbatch/scontrol here, and the job's steps
    try:
        started = subprocess.run(["bash", str(CLUSTER), "start", "--netns", str(state)], env=nodes.env,
                                 capture_output=True, text=True, timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
        yield nodes, state
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", "--netns", str(state)], env=nodes.env, capture_output=True,
                       timeout=120)
        if (state / "log").is_dir():
            shutil.copytree(state / "log", tmp_path / "slurm-log")
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slow
def test_disaggregated_job_spans_two_slurm_nodes_and_requeues(slurm_nodes, tmp_path):
    (nodes, state), ckpt, run = slurm_nodes, tmp_path / "ckpt", tmp_path / "run"
    job = SlurmJob(nodes=2, gpus_per_node=0, cpus_per_node=2, layout="disaggregated", rollout_nodes=1,
                   config=str(ROOT / "launch/configs/cpu_demo.yaml"), overrides=[*TINY, f"logging.dir={run}"],
                   workdir=str(ROOT), venv=str(Path(sys.executable).parent.parent), job_name="qurl-2n",
                   log_dir=str(tmp_path / "logs"), ckpt_dir=str(ckpt), object_store_bytes=256 * 2**20)
    script, job_id = submit(job)
    rendered = script.read_text()  # the rendered command, not one written for the test
    assert "layout=disaggregated" in rendered and f"checkpoint.dir={ckpt}" in rendered
    log = tmp_path / "logs" / f"qurl-2n-{job_id}.out"
    text = _requeued_once_to_completion(job_id, ckpt, log, state)
    # both starts ran on the two nodes, and Ray spanned them: the worker joined the head across the link
    assert text.count(f"on {nodes.env['QURL_NETNS_PREFIX']}-[1-2] at") == 2, text
    ready = re.findall(r"\[ray\] 2/2 nodes up: (.*)", text)
    assert len(ready) == 2 and all(f"'node:{nodes.addr(k)}': 1.0" in r for r in ready for k in (1, 2)), text
    # trainer on node 1 (qurl_train), engine on node 2 (qurl_rollout), weights across: the disaggregated run
    assert text.count(f"weights go to the engines by gloo broadcast (group at {nodes.addr(1)}:") == 2, text
    # the requeue path of the one-node job
    stopped = int(re.search(r"SIGTERM at step (\d+): checkpoint written", text).group(1))
    assert 1 <= stopped < STEPS and "training exited with status 75" in text, text
    assert "Kill job error" not in text  # the SIGTERM went to the training step's node alone
    assert text.index("checkpoint written") < text.index("requeueing job")
    assert f"resuming at step {stopped} from {ckpt}" in text
    final = latest_checkpoint(ckpt)  # the newest checkpoint that verifies against its checksums
    assert read_meta(final)["step"] == STEPS and (final / "trainer" / "__0_0.distcp").stat().st_size > 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # one row a step across the requeue


def _wait_for_checkpoint(job_id: str, ckpt: Path, log: Path, state: Path, timeout: float = 600) -> None:
    """Until the job's run has written its first checkpoint (step 1 done and saved); fails at once if the
    training step exited or the job left RUNNING (a launch failure requeues it), with Slurm's word on why."""
    deadline = time.monotonic() + timeout
    while latest_checkpoint(ckpt) is None:
        text = log.read_text() if log.exists() else ""
        assert "training exited" not in text, text[-4000:]
        fields = _job_fields(job_id)
        running = fields.get("Restarts") == "0" and fields.get("JobState") in ("PENDING", "RUNNING")
        if not running or time.monotonic() > deadline:
            pytest.fail(f"no checkpoint: job {job_id} {fields.get('JobState')} ({fields.get('Reason')}), "
                        f"restarts {fields.get('Restarts')}\n{text[-2000:]}{slurm_logs(state)}")
        time.sleep(1)


def _requeued_once_to_completion(job_id: str, ckpt: Path, log: Path, state: Path) -> str:
    """Once the run's first checkpoint is written, signal the job as Slurm does its --signal grace period before
    the time limit; the job must requeue once and complete. Returns its log."""
    _wait_for_checkpoint(job_id, ckpt, log, state)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    _release_when_requeued(job_id)
    fields = _wait_for(job_id, state, timeout=600)
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0" and fields["Restarts"] == "1", text
    return text


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
