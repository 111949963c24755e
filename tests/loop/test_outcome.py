"""How a run ends: the stop request a signal turns into."""
import os
import signal

from qurl_mcore.loop.outcome import StopRequest


def test_sigterm_becomes_a_flag():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop = StopRequest()
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
    finally:
        signal.signal(signal.SIGTERM, previous)
