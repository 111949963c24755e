"""Programs that end with the process that started them: Linux's parent-death signal, armed before the exec.

A server started in a session of its own (so that it and its workers can be stopped as one process group)
outlives its parent by default: a parent killed by the OOM killer or SIGKILL leaves it running, holding its
GPU memory and its port. `with_parent_death(argv)` runs `argv` through this module, which asks the kernel
for SIGKILL when the parent goes (prctl PR_SET_PDEATHSIG, kept across exec) and then becomes the program:

    python -m qurl_mcore.parent_death PARENT_PID PROGRAM [ARGS ...]

The kernel signals when the *thread* that forked the child ends: start such programs from a thread that
lives as long as they should (a Ray actor's, which runs its methods on its main thread).

`descendants` and `stop_survivors` are the check at the end of a run: what it started (Ray's daemons, whose
agents the raylet starts without that signal, and what they started) is gone, or is stopped and named. A run
killed outright (SIGKILL) runs no check: `start_reaper` starts a watcher, in a session of its own, that notes
the run's processes every second and kills those still running once the run is gone:

    python -m qurl_mcore.parent_death --reap PID
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def with_parent_death(argv: list[str]) -> list[str]:
    """`argv`, run so that it gets SIGKILL when this process dies (on Linux; elsewhere `argv` itself)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-m", __name__, str(os.getpid()), *argv]


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(command name, state, parent pid) of process `pid` from /proc; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
    return name, rest[0], int(rest[1])


def _running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z"  # a zombie has ended; only its reaper has not looked yet


def descendants(pid: int | None = None) -> list[int]:
    """The processes below `pid` (default: this one), children first, from /proc (Linux; elsewhere none)."""
    parents = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _stat(int(entry.name))
        if stat is not None:
            parents[int(entry.name)] = stat[2]
    out, frontier = [], [os.getpid() if pid is None else pid]
    while frontier:
        children = sorted(p for p, parent in parents.items() if parent in frontier)
        out += children
        frontier = children
    return out


def stop_survivors(pids: list[int], grace_s: float) -> list[str]:
    """Wait up to `grace_s` seconds for `pids` to end, SIGKILL those still running, and return them as
    "pid (command name)"."""
    deadline = time.monotonic() + grace_s
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    for pid in pids:
        stat = _stat(pid)
        if stat is not None and stat[1] != "Z":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(f"{pid} ({stat[0]})")
    return killed


def _started(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc's field 22): a pid the kernel reused has
    another."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def reap_when_gone(pid: int, poll_s: float = 1.0) -> None:
    """Until process `pid` ends, note its descendants every `poll_s` seconds; then SIGKILL those still running
    (the very processes noted: a pid reused since is left alone)."""
    noted: dict[int, str] = {}
    while _running(pid):
        for child in descendants(pid):
            if child != os.getpid() and (started := _started(child)) is not None:
                noted[child] = started
        time.sleep(poll_s)
    for child, started in noted.items():
        if _running(child) and _started(child) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def start_reaper() -> subprocess.Popen | None:
    """A watcher that kills what this process started once it is gone, however it ends (`reap_when_gone`), in
    a session of its own (a signal to this process group spares it); None off Linux. Stop it (`kill`) when
    this process has stopped what it started itself."""
    if not sys.platform.startswith("linux"):
        return None
    return subprocess.Popen([sys.executable, "-m", __name__, "--reap", str(os.getpid())], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(args: list[str]) -> None:
    if args[0] == "--reap":
        reap_when_gone(int(args[1]))
        return
    parent, argv = int(args[0]), args[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the signal was armed: nobody is left to stop us
        sys.exit(f"{argv[0]}: not started, its parent {parent} is gone")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
