"""`qurl_mcore.parent_death`: a program started through it (as HttpEngine starts SGLang servers) ends with the
process that started it, also when that process is SIGKILLed and the program runs in a session of its own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import subprocess, sys, time
from qurl_mcore.parent_death import with_parent_death
child = subprocess.Popen(with_parent_death(["sleep", "120"]), start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie waiting for its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_server_dies_with_the_process_that_started_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while _cmdline(child)[0] != "sleep":  # the shim has armed the signal and become the program
            assert time.monotonic() < deadline, _cmdline(child)
            time.sleep(0.05)
        parent.kill()  # SIGKILL: no handler, no cleanup of its own
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the program outlived the process that started it"
    finally:
        parent.kill()
        if _running(child):
            os.kill(child, signal.SIGKILL)


def test_what_outlives_a_run_is_found_stopped_and_named():
    from qurl_mcore.parent_death import descendants, stop_survivors

    # a test worker may hold processes of earlier tests: this test's are the ones that were not there before
    before = set(descendants())
    quick = subprocess.Popen(["sleep", "0.2"])
    lingering = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])  # and a grandchild
    try:
        deadline = time.monotonic() + 10
        while len(set(descendants()) - before) < 3:
            assert time.monotonic() < deadline, descendants()
            time.sleep(0.05)
        below = [pid for pid in descendants() if pid not in before]
        assert {quick.pid, lingering.pid} <= set(below) and len(below) == 3
        killed = stop_survivors(below, grace_s=2.0)
        assert sorted(killed) == sorted(f"{pid} ({name})" for pid, name in
                                        [(lingering.pid, "sh"), (max(set(below) - {quick.pid, lingering.pid}), "sleep")])
        deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
        while any(_running(pid) for pid in below) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(pid) for pid in below)
    finally:
        lingering.kill()
        quick.wait()
        lingering.wait()


KILLED_DRIVER = """
import subprocess, time
from qurl_mcore.parent_death import start_reaper
start_reaper()
time.sleep(1)
daemon = subprocess.Popen(["sh", "-c", "sleep 120 & wait"], start_new_session=True)  # as Ray's agents: no fate
print(daemon.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")
def test_what_a_killed_run_started_is_reaped():
    """kill -9 of the driver runs none of its cleanup: its reaper kills what it had started (Ray's agents)."""
    from qurl_mcore.parent_death import descendants

    driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    daemon = int(driver.stdout.readline())
    grandchild = None
    try:
        deadline = time.monotonic() + 30
        while not descendants(daemon):  # its child `sleep` is up
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (grandchild,) = descendants(daemon)
        time.sleep(2.5)  # the reaper has noted both
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 15
        while (_running(daemon) or _running(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(daemon) and not _running(grandchild), "the killed run's processes outlived it"
    finally:
        driver.kill()
        for pid in (daemon, grandchild):
            if pid is not None and _running(pid):
                os.kill(pid, signal.SIGKILL)
