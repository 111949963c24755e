"""Programs that end with the process that started them: Linux's parent-death signal, armed before the exec.

A server started in a session of its own (so that it and its workers can be stopped as one process group)
outlives its parent by default: a parent killed by the OOM killer or SIGKILL leaves it running, holding its
GPU memory and its port. `with_parent_death(argv)` runs `argv` through this module, which asks the kernel
for SIGKILL when the parent goes (prctl PR_SET_PDEATHSIG, kept across exec) and then becomes the program:

    python -m qurl_mcore.parent_death PARENT_PID PROGRAM [ARGS ...]

The kernel signals when the *thread* that forked the child ends: start such programs from a thread that
lives as long as they should (a Ray actor's, which runs its methods on its main thread).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def with_parent_death(argv: list[str]) -> list[str]:
    """`argv`, run so that it gets SIGKILL when this process dies (on Linux; elsewhere `argv` itself)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-m", __name__, str(os.getpid()), *argv]


def main(args: list[str]) -> None:
    parent, argv = int(args[0]), args[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the signal was armed: nobody is left to stop us
        sys.exit(f"{argv[0]}: not started, its parent {parent} is gone")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
