"""How a run ends, for people and for schedulers: `qurl train`'s exit codes, the failure that ends a run, and
the stop request a signal turns into.

  0   EXIT_FINISHED    every step done, final checkpoint written
  1   EXIT_FAILED      an actor failed (RunFailure names it); the last checkpoint stays for a resume
  2   EXIT_BAD_CONFIG  the config or the cluster cannot run (every problem listed); nothing was started
  75  EXIT_STOPPED     stopped by SIGTERM/SIGINT with a checkpoint written: run the same command to resume
                       (75 is sysexits' EX_TEMPFAIL, "try again later")
  130 EXIT_INTERRUPTED Ctrl-C before the run could checkpoint (while it starts, or a second one): start it again
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import time

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 128 + signal.SIGINT  # the shell's status for a process SIGINT ended


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # colour codes Ray puts in the errors it relays


def error_line(err: BaseException) -> str:
    """The cause of an actor's (Ray) error in one line, colour codes removed, at most 500 characters: the
    actor's own exception, or the last line Ray gives for how its process ended."""
    cause = getattr(err, "cause", None)
    if cause is not None and not isinstance(cause, type(err)):
        text = f"{type(cause).__name__}: {cause}"
        lines = [line.strip() for line in _ANSI.sub("", text).splitlines() if line.strip()][:1]
    else:
        lines = [line.strip() for line in _ANSI.sub("", str(err)).splitlines() if line.strip()][-1:]
    return (lines[0] if lines else type(err).__name__)[:500]


class RunFailure(RuntimeError):
    """The run cannot go on (a trainer rank or the rollout manager failed, an engine never started or keeps
    failing, the cluster never placed the run): the message names the actor and the cause."""


@contextlib.contextmanager
def shielded_children(signals=(signal.SIGTERM,)):
    """The processes started meanwhile (a local Ray's daemons and workers, and what they start) begin with
    `signals` blocked, a mask they keep: a signal to the whole process group (`timeout`, a scheduler) reaches
    this process alone, which checkpoints and then stops them, instead of killing Ray's GCS under it. This
    process's own mask is back afterwards (its threads started meanwhile keep it: the signal goes to the
    main thread, where Python handles it)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class StopOverdue(RuntimeError):
    """A stop was requested and the step in progress did not end within its grace: the run exits without it."""


class StopRequest:
    """Turns SIGTERM (Slurm preemption, the job script's time-limit warning) and SIGINT (Ctrl-C) into a flag
    the loop checks between steps and while it waits, so it checkpoints and exits instead of dying mid-step.
    A second SIGINT interrupts at once (KeyboardInterrupt). The signal is acknowledged on stderr at once; a
    step still in progress `grace_s` seconds later is abandoned (`overdue`, `StopOverdue`). `restore` puts back
    the handlers it replaced."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT), grace_s: float = 20.0):
        self.requested = False
        self.signal_name = ""
        self.grace_s = grace_s
        self.requested_at = 0.0
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def overdue(self) -> bool:
        """Whether a stop was requested more than `grace_s` seconds ago, while steps were running."""
        return self.requested and time.monotonic() - self.requested_at > self.grace_s

    def steps_ended(self) -> None:
        """No step is running any more: what follows (the stop's checkpoint) is not cut short by the grace."""
        self.grace_s = float("inf")

    def restore(self) -> None:
        """The signals' handlers as they were before this request took them."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, _frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.requested:
            return
        self.requested, self.requested_at = True, time.monotonic()
        self.signal_name = signal.Signals(signum).name
        # os.write: a signal handler must not re-enter the buffered stream it may have interrupted
        os.write(2, f"\nqurl train: {self.signal_name} received: checkpointing after the step in progress, or "
                    f"exiting without it if it takes over {self.grace_s:g} s (checkpoint.stop_grace_s)\n".encode())
