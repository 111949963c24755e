"""init_parallel's rendezvous for a lone process."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_lone_process_keeps_its_port_to_itself():
    """A lone process (no RANK/MASTER_PORT) rendezvouses on a free port of its own without writing it into
    the environment: a child it starts (the GPU check's test run) inherits no port this process still holds,
    and starts its own group beside it."""
    code = textwrap.dedent("""
        import os, subprocess, sys
        from qurl_mcore.megatron.parallel import destroy_parallel, init_parallel
        init_parallel()
        assert "MASTER_PORT" not in os.environ, os.environ["MASTER_PORT"]
        child = "from qurl_mcore.megatron.parallel import init_parallel; init_parallel(); print('child up')"
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=240)
        assert out.returncode == 0 and "child up" in out.stdout, out.stderr[-2000:]
        destroy_parallel()
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
