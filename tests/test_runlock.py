"""One run per directory (`qurl_mcore.runlock`): a second run is refused naming the first; a lock left by a
process that died is taken over; one left on another host is refused until the user removes it."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from qurl_mcore.runlock import LOCK_FILE, DirectoryInUse, lock_dirs

_HOLD = """
import sys, time
from qurl_mcore.runlock import lock_dirs
lock = lock_dirs(*sys.argv[1:], command="qurl train --config other.yaml")
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def other_run(tmp_path):
    """Start another process that locks the given directories; yields (start, its Popen objects)."""
    started = []

    def start(*dirs):
        proc = subprocess.Popen([sys.executable, "-c", _HOLD, *map(str, dirs)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.getcwd()})
        started.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_second_run_on_a_locked_directory_is_refused_naming_the_first(tmp_path, other_run):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    first = other_run(ckpt, logs)
    with pytest.raises(DirectoryInUse) as err:
        lock_dirs(tmp_path / "mine", ckpt)
    text = str(err.value)
    assert f"{ckpt} is in use by another run: pid {first.pid} on {socket.gethostname()} since " in text
    assert "(qurl train --config other.yaml)" in text and "its own checkpoint.dir" in text
    assert not (tmp_path / "mine" / LOCK_FILE).exists()  # what it had taken is given back
    first.kill()
    first.wait()
    with lock_dirs(ckpt, logs):  # the first died: its record is stale, the flock gone
        record = json.loads((ckpt / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid()
    assert not (ckpt / LOCK_FILE).exists() and not (logs / LOCK_FILE).exists()


def test_a_lock_left_on_another_host_is_refused_until_removed(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 4242, "host": "node-7", "started": 1.0,
                                                  "since": time.time(), "command": "qurl train"}))
    with pytest.raises(DirectoryInUse, match=rf"run on another host: pid 4242 on node-7 .*remove {tmp_path}/"):
        lock_dirs(tmp_path)
    (tmp_path / LOCK_FILE).unlink()
    lock_dirs(tmp_path).release()


def test_a_live_process_named_by_a_record_without_a_lock_is_refused_a_dead_one_taken_over(tmp_path):
    import psutil

    parent = psutil.Process(os.getppid())
    record = {"pid": parent.pid, "host": socket.gethostname(), "started": parent.create_time(), "since": 0}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))
    with pytest.raises(DirectoryInUse, match=f"pid {parent.pid} .*holds no lock, yet runs"):
        lock_dirs(tmp_path)
    (tmp_path / LOCK_FILE).write_text(json.dumps({**record, "started": parent.create_time() - 1}))  # pid reused
    lock_dirs(tmp_path).release()


def test_one_directory_for_checkpoints_and_logs_is_locked_once(tmp_path):
    lock = lock_dirs(tmp_path, tmp_path / "logs" / "..")
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_qurl_train_refuses_a_checkpoint_dir_another_run_holds(tmp_path, other_run):
    first = other_run(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, "-m", "qurl_mcore", "train", "model.path=tiny-llama", "steps=1",
                          f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'logs'}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{tmp_path / 'ckpt'} is in use by another run: pid {first.pid}" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "logs" / "driver.log").exists()
