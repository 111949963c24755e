"""Nodes of our own for tests that cross a node boundary: network namespaces made by launch/netns_cluster.sh,
each with its own address on a private bridge, and a Ray cluster across them (launch/ray_cluster.sh)."""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NETNS = ROOT / "launch" / "netns_cluster.sh"
RAY_CLUSTER = ROOT / "launch" / "ray_cluster.sh"


def unavailable() -> str | None:
    """Why this machine cannot make namespace nodes, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return None


class Nodes:
    """`count` namespace nodes, names and a /24 of their own per process (tests may run side by side)."""

    def __init__(self, count: int, state_dir: Path):
        tag = os.getpid() % 200
        state_dir.mkdir(parents=True, exist_ok=True)
        token = state_dir / "ray-token"  # the cluster's token (ray_cluster.sh runs every cluster with one)
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = {**os.environ, "QURL_NETNS_PREFIX": f"qt{os.getpid() % 100000}",
                    "QURL_NETNS_SUBNET": f"10.231.{tag + 20}", "QURL_RAY_STATE_DIR": str(state_dir),
                    "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN_PATH": str(token)}
        # other machines: not this process's cluster, token or gloo interface
        for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "GLOO_SOCKET_IFNAME"):
            self.env.pop(key, None)
        self.count = count
        self.ray: list[subprocess.Popen] = []
        out = subprocess.run(["bash", str(NETNS), "up", str(count)], env=self.env, capture_output=True, text=True)
        if out.returncode:
            self.down()
            raise RuntimeError(f"netns_cluster.sh up {count} failed: {out.stderr}")

    def addr(self, k: int) -> str:
        return f"{self.env['QURL_NETNS_SUBNET']}.{k}"

    def command(self, k: int, *argv: str) -> list[str]:
        return ["bash", str(NETNS), "exec", str(k), *argv]

    def run(self, k: int, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(k, *argv), env=self.env, capture_output=True, text=True, timeout=timeout)

    def start_ray(self, resources: dict[int, str], log_dir: Path, cpus: int = 2, port: int = 6379) -> str:
        """A Ray head on node 1 and a worker on every other node of `resources` (node -> custom resources JSON),
        each in the background through ray_cluster.sh; returns the head's address once all have joined."""
        head = f"{self.addr(1)}:{port}"
        for k, res in sorted(resources.items()):
            self.start_ray_node(k, res, head, log_dir, cpus)
        self.wait_for_ray(head, len(resources), log_dir)
        return head

    def start_ray_node(self, k: int, resources: str, head: str, log_dir: Path, cpus: int = 2) -> None:
        """Node k's Ray process in the background: the head at `head` on node 1, a worker joining it elsewhere
        (again, after `kill`); its output goes to the end of log_dir/ray-node<k>.log."""
        role = ["head", "--port", head.rsplit(":", 1)[1], "--node-ip", self.addr(1)] if k == 1 else [
            "worker", "--address", head]
        self.ray.append(subprocess.Popen(
            self.command(k, "bash", str(RAY_CLUSTER), *role, "--num-cpus", str(cpus),
                         "--object-store-bytes", str(200 << 20), "--resources", resources),
            env=self.env, stdout=open(log_dir / f"ray-node{k}.log", "a"), stderr=subprocess.STDOUT))

    def wait_for_ray(self, head: str, count: int, log_dir: Path) -> None:
        """Until `count` Ray nodes are alive in the cluster of `head` (at most 120 s)."""
        ready = self.run(1, "bash", str(RAY_CLUSTER), "wait", "--address", head, "--nodes", str(count),
                         "--timeout", "120", timeout=180)
        if ready.returncode:
            logs = "".join(p.read_text()[-2000:] for p in sorted(log_dir.glob("ray-node*.log")))
            raise RuntimeError(f"the Ray cluster across the nodes did not come up: {ready.stderr}\n{logs}")

    def link(self, k: int, state: str) -> None:
        """Node k's link to the others "up" or "down" (packets dropped silently, nothing is reset)."""
        subprocess.run(["bash", str(NETNS), "link", str(k), state], env=self.env, check=True, timeout=30)

    def sent_to(self, k: int) -> Path:
        """The file that counts the bytes sent to node k over its link (read it as often as needed)."""
        name = subprocess.run(["bash", str(NETNS), "link", str(k)], env=self.env, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        return Path(f"/sys/class/net/{name}/statistics/tx_bytes")

    def kill(self, k: int) -> None:
        """Kill every process on node k (its Ray processes and the servers they started): the node crashed."""
        subprocess.run(["bash", str(NETNS), "kill", str(k)], env=self.env, check=True, timeout=30)

    def down(self) -> None:
        """Kill everything in the nodes (Ray included) and delete them."""
        subprocess.run(["bash", str(NETNS), "down"], env=self.env, capture_output=True, timeout=120)
        for process in self.ray:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
