"""launch/ray_cluster.sh against a real Ray head on this machine."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qurl_mcore.transfer import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "ray_cluster.sh"


def _env(**extra):
    # the script uses `ray` and `python` from PATH: the test's own environment
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra}
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(key, None)
    return env


@pytest.mark.slow
def test_head_wait_and_clean_shutdown(tmp_path):
    # The head makes a token of its own (not the one any earlier local ray.init leaves in ~/.ray) and runs with
    # token authentication; the readiness check on the same host finds it by the head's address.
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = _env(HOME=str(home))
    port, dash = free_port(), free_port()
    head = subprocess.Popen(
        ["bash", str(SCRIPT), "head", "--port", str(port), "--dashboard-port", str(dash), "--num-cpus", "1",
         "--object-store-bytes", str(200 * 2**20), "--node-ip", "127.0.0.1", "--resources", '{"qurl_train": 1}'],
        env=env, stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        ready = subprocess.run(["bash", str(SCRIPT), "wait", "--address", f"127.0.0.1:{port}", "--nodes", "1",
                                "--timeout", "120"], env=env, capture_output=True, text=True, timeout=180)
        assert ready.returncode == 0, ready.stderr + (tmp_path / "head.log").read_text()
        assert "1/1 nodes up" in ready.stdout and "'qurl_train': 1.0" in ready.stdout
        # a client without the token is refused
        intruder = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='127.0.0.1:{port}')"],
                                  env=_env(HOME=str(tmp_path)), capture_output=True, text=True, timeout=180)
        assert intruder.returncode != 0 and "token" in intruder.stderr.lower(), intruder.stderr[-2000:]
        # asking for more nodes than exist times out with an explanation
        short = subprocess.run(["bash", str(SCRIPT), "wait", "--address", f"127.0.0.1:{port}", "--nodes", "2",
                                "--timeout", "3"], env=env, capture_output=True, text=True, timeout=120)
        assert short.returncode != 0 and "only 1/2 nodes joined" in short.stderr
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # what Slurm does when the step ends
        stopping = time.monotonic()
        head.wait(timeout=60)
    # well within Slurm's KillWait (30 s by default), after which whatever still runs is SIGKILLed
    assert time.monotonic() - stopping < 15, "the head took longer than Slurm waits before SIGKILL"
    assert head.returncode == 0
    token = home / ".qurl" / "ray" / f"token-127.0.0.1-{port}"
    assert token.stat().st_mode & 0o777 == 0o600 and token.read_text() != "0123456789abcdef" * 4
    # the head stopped Ray: nothing listens on its port any more, and a later ray.init() without an address on
    # this machine is no longer sent to it
    current = Path("/tmp/ray/ray_current_cluster")
    assert not current.exists() or not current.read_text().strip().endswith(f":{port}")
    time.sleep(1)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_launch_scripts_are_shellcheck_clean():
    scripts = sorted(SCRIPT.parent.glob("*.sh")) + sorted(SCRIPT.parent.glob("slurm/*.sh"))
    assert SCRIPT in scripts
    out = subprocess.run([str(Path(sys.executable).parent / "shellcheck"), "-S", "info", *map(str, scripts)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def _stub_ray(tmp_path: Path) -> dict:
    """An environment whose `ray` prints its arguments and the auth variables it got, then exits (the head's
    `ray start --block` returns at once): what the script starts, without starting it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "ray"
    stub.write_text('#!/bin/bash\necho "ray $*"\necho "mode=$RAY_AUTH_MODE path=${RAY_AUTH_TOKEN_PATH:-}"\n')
    stub.chmod(0o755)
    env = _env(HOME=str(tmp_path / "home"), QURL_RAY_STATE_DIR=str(tmp_path / "state"))
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env


def test_a_head_makes_its_own_token_and_binds_the_dashboard_to_its_address(tmp_path):
    """No token given: the head makes one (64 hex digits, 0600, in a directory only the user reads) and runs
    with token authentication, its dashboard on the head's address, not 0.0.0.0 (unless asked); a worker or
    client of that head on the same host finds the token by the head's address; one with no token is refused."""
    env = _stub_ray(tmp_path)
    head = subprocess.run(["bash", str(SCRIPT), "head", "--port", "7001", "--node-ip", "10.9.8.7"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert head.returncode == 0, head.stderr
    token = tmp_path / "home" / ".qurl" / "ray" / "token-10.9.8.7-7001"
    assert re.fullmatch(r"[0-9a-f]{64}", token.read_text())
    assert token.stat().st_mode & 0o777 == 0o600 and token.parent.stat().st_mode & 0o777 == 0o700
    assert f"mode=token path={token}" in head.stdout and str(token) in head.stdout
    assert "--dashboard-host 10.9.8.7 " in head.stdout and "0.0.0.0" not in head.stdout
    again = subprocess.run(["bash", str(SCRIPT), "head", "--port", "7001", "--node-ip", "10.9.8.7"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and re.fullmatch(r"[0-9a-f]{64}", token.read_text())
    worker = subprocess.run(["bash", str(SCRIPT), "worker", "--address", "10.9.8.7:7001"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert worker.returncode == 0 and f"mode=token path={token}" in worker.stdout, worker.stderr
    lost = subprocess.run(["bash", str(SCRIPT), "worker", "--address", "10.9.8.6:7001"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert lost.returncode != 0 and "no token for the Ray cluster at 10.9.8.6:7001" in lost.stderr
    anywhere = subprocess.run(["bash", str(SCRIPT), "head", "--node-ip", "10.9.8.7"], capture_output=True, text=True,
                              env={**env, "QURL_RAY_DASHBOARD_HOST": "0.0.0.0", "RAY_AUTH_TOKEN": "ab" * 32},
                              timeout=60)
    assert "--dashboard-host 0.0.0.0 " in anywhere.stdout and "mode=token path=\n" in anywhere.stdout
    off = subprocess.run(["bash", str(SCRIPT), "head"], env={**env, "RAY_AUTH_MODE": "disabled"},
                         capture_output=True, text=True, timeout=60)
    assert off.returncode != 0 and "token authentication" in off.stderr and "ray " not in off.stdout


def test_usage_errors_name_the_missing_option():
    out = subprocess.run(["bash", str(SCRIPT), "worker"], env=_env(), capture_output=True, text=True)
    assert out.returncode != 0 and "worker needs --address" in out.stderr
    out = subprocess.run(["bash", str(SCRIPT), "head", "--bogus"], env=_env(), capture_output=True, text=True)
    assert out.returncode != 0 and "unknown option --bogus" in out.stderr


@pytest.mark.parametrize("cmd", ["wait", "submit"])
def test_wait_and_submit_need_an_address(cmd):
    out = subprocess.run(["bash", str(SCRIPT), cmd], env=_env(), capture_output=True, text=True)
    assert out.returncode != 0 and "--address" in out.stderr


@pytest.mark.slow
def test_a_head_and_a_worker_on_two_nodes_and_each_stop_stops_its_own(netns_nodes, tmp_path):
    """Two hosts (network namespaces, each its own address): the worker joins the head across the link, `wait`
    sees both, and `stop` on a node stops that node's Ray alone (it used to be `ray stop --force`, which stops
    every Ray process of the machine: another node sharing it, or another user's cluster)."""
    nodes = netns_nodes(2)
    head = nodes.start_ray({1: '{"qurl_train": 1}', 2: '{"qurl_rollout": 1}'}, tmp_path, cpus=1)
    alive = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
             "print(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))")
    both = nodes.run(1, sys.executable, "-c", alive, head)
    assert both.stdout.split("\n")[-2] == str(sorted([nodes.addr(1), nodes.addr(2)])), both.stderr[-2000:]
    stopped = nodes.run(2, "bash", str(SCRIPT), "stop")
    assert stopped.returncode == 0 and "stopped the node" in stopped.stdout, stopped.stderr
    assert nodes.ray[1].wait(timeout=60) == 0
    left = nodes.run(1, sys.executable, "-c", alive, head)
    assert left.stdout.split("\n")[-2] == str([nodes.addr(1)]), left.stderr[-2000:]
    again = nodes.run(2, "bash", str(SCRIPT), "stop")
    assert again.returncode != 0 and "no Ray node of this host" in again.stderr
    assert nodes.run(1, "bash", str(SCRIPT), "stop").returncode == 0
    assert nodes.ray[0].wait(timeout=60) == 0
