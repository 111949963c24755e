"""How a run ends: the stop request a signal turns into, and an actor's error as one line."""
import os
import signal

from qurl_mcore.loop.outcome import StopRequest, error_line, shielded_children


def test_sigterm_becomes_a_flag_and_the_handlers_before_come_back(capfd):
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    interrupt = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN in a background job
    try:
        stop = StopRequest()
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM" and not stop.overdue()
        stop.requested_at -= 21  # 21 s later the step in progress is overdue, but not the checkpoint after it
        assert stop.overdue()
        stop.steps_ended()
        assert not stop.overdue()
        assert ("qurl train: SIGTERM received: checkpointing after the step in progress, or exiting without it if "
                "it takes over 20 s (checkpoint.stop_grace_s)") in capfd.readouterr().err  # at once
        stop.restore()
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is interrupt
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_actors_error_is_one_line_without_colour_codes():
    class RayError(Exception):  # the shape of Ray's errors: a multi-line, coloured text and the actor's cause
        def __init__(self, text, cause=None):
            super().__init__(text)
            self.cause = cause

    died = RayError("\x1b[36mray::EngineHost.generate()\x1b[39m (pid=7, ip=10.0.0.2)\n  File \"x.py\", line 3\n"
                    "\x1b[31mActorDiedError: the actor died unexpectedly\x1b[0m\n\n")
    assert error_line(died) == "ActorDiedError: the actor died unexpectedly"
    raised = RayError("ray::PolicyTrainer.step() ...\nTraceback ...", cause=ValueError("\x1b[1mbad batch\x1b[0m\nmore"))
    assert error_line(raised) == "ValueError: bad batch"
    assert len(error_line(RayError("x" * 2000))) == 500


def test_processes_started_shielded_ignore_a_group_sigterm_and_the_mask_comes_back():
    """Ray's daemons start inside `shielded_children`: a SIGTERM to the whole process group leaves them
    running for the driver's checkpoint; the driver itself still gets its signals."""
    import subprocess
    import time

    with shielded_children():
        child = subprocess.Popen(["sleep", "30"])
    try:
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        os.kill(child.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert child.poll() is None  # blocked: pending, never delivered
    finally:
        child.kill()
        child.wait()
