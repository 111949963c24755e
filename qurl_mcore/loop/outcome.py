"""How a run ends, for people and for schedulers: `qurl train`'s exit codes and the failure that ends a run.

  0   EXIT_FINISHED    every step done, final checkpoint written
  1   EXIT_FAILED      an actor failed (RunFailure names it); the last checkpoint stays for a resume
  2   EXIT_BAD_CONFIG  the config or the cluster cannot run (every problem listed); nothing was started
  75  EXIT_STOPPED     stopped by SIGTERM/SIGINT with a checkpoint written: run the same command to resume
                       (75 is sysexits' EX_TEMPFAIL, "try again later")
"""
from __future__ import annotations

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2
EXIT_STOPPED = 75


class RunFailure(RuntimeError):
    """The run cannot go on (a trainer rank or the rollout manager failed, an engine never started or keeps
    failing, the cluster never placed the run): the message names the actor and the cause."""
