"""launch/ray_cluster.sh against a real Ray head on this machine."""
import os
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
@pytest.mark.parametrize("token", [False, True], ids=["no-token", "token-in-home"])
def test_head_wait_and_clean_shutdown(tmp_path, token):
    # A token in ~/.ray (any earlier local ray.init leaves one) turns the head's token auth on; the script must
    # then make its clients use it too, and use no auth when there is none.
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    if token:
        (home / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = _env(HOME=str(home))
    mode = subprocess.run(["bash", str(SCRIPT), "auth-mode"], env=env, capture_output=True, text=True)
    assert mode.stdout.strip() == ("token" if token else "disabled")
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
        # asking for more nodes than exist times out with an explanation
        short = subprocess.run(["bash", str(SCRIPT), "wait", "--address", f"127.0.0.1:{port}", "--nodes", "2",
                                "--timeout", "3"], env=env, capture_output=True, text=True, timeout=120)
        assert short.returncode != 0 and "only 1/2 nodes joined" in short.stderr
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # what Slurm does when the step ends
        head.wait(timeout=60)
    assert head.returncode == 0
    # the head stopped Ray: nothing listens on its port any more
    time.sleep(1)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


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
