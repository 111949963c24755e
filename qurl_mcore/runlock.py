"""One run per directory: a run locks its `checkpoint.dir` and `logging.dir` for its lifetime.

Two runs given one checkpoint.dir would each resume from and delete the other's checkpoints. So each
directory gets a lock file, `.qurl-run.lock`, that the run holds with `flock` while it lives and fills with
who holds it: pid, host, process start time, since when, the command. The kernel drops an flock when its
process dies, however it dies; the record stays behind, and is read this way:

- the flock is held: another run is alive; refused, naming it;
- the record names this host and a process that no longer runs (pid gone or reused: its start time differs):
  stale, taken over;
- the record names another host (a shared filesystem): whether that run lives cannot be told from here;
  refused, naming it, until the user removes the file.

A run that ends removes its lock files; a new run takes the lock only on a file still in its directory.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
import typing
from pathlib import Path

from qurl_mcore.config import ConfigError

LOCK_FILE = ".qurl-run.lock"


class DirectoryInUse(ConfigError):
    """Another run holds (or may hold) the lock of a directory this run needs."""


def _started(pid: int) -> float | None:
    """The start time of process `pid`, or None if there is none."""
    # psutil: SGLang's requirement, not qurl-mcore's; only this check uses it
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return (f"pid {holder.get('pid')} on {holder.get('host')} since {since}"
            + (f" ({holder['command']})" if holder.get("command") else ""))


class RunLock:
    """The locks of one run's directories; `release` (or the process's end) frees them."""

    def __init__(self) -> None:
        self._held: list[tuple[Path, typing.BinaryIO]] = []  # the lock files, open

    def _take(self, directory: Path, record: dict) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_FILE
        while True:
            # a file object: should a run fail before `release`, collecting it unlocks
            file = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b")
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.close()
                raise DirectoryInUse(_held(directory, path)) from None
            if path.exists() and os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
                break
            file.close()  # the holder released (unlinked) the file between our open and our flock: open it anew
        fd = file.fileno()
        try:
            problem = _unlocked_holder(directory, path, record)
            if problem:
                raise DirectoryInUse(problem)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
        except BaseException:
            file.close()
            raise
        self._held.append((path, file))

    def release(self) -> None:
        """Remove every lock file (the directories are as the run found them) and drop the flocks."""
        for path, file in reversed(self._held):
            path.unlink(missing_ok=True)  # before the flock goes: no one can take a file being removed
            file.close()
        self._held.clear()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _held(directory: Path, path: Path) -> str:
    return (f"{directory} is in use by another run: {_describe(_read(path))}; wait for it to end or give this run "
            "its own checkpoint.dir and logging.dir")


def _unlocked_holder(directory: Path, path: Path, record: dict) -> str | None:
    """Why the record of an unlocked lock file `path` still bars a run of `record`'s host and pid, or None."""
    holder = _read(path)
    if holder and holder.get("host") != record["host"]:
        return (f"{directory} is in use by a run on another host: {_describe(holder)}; if that run is over, "
                f"remove {path} and start again")
    alive = holder.get("started") is not None and _started(holder.get("pid", -1)) == holder["started"]
    if alive and holder["pid"] != record["pid"]:
        return (f"{directory} is in use by another run: {_describe(holder)} (it holds no lock, yet runs); if it is "
                f"not a run, remove {path}")
    return None


def in_use(directory: str | Path) -> str | None:
    """Why a run could not lock `directory` now (`lock_dirs` would refuse it, naming the holder), or None;
    takes no lock and creates nothing (`qurl train --check`)."""
    directory = Path(directory).resolve()
    path = directory / LOCK_FILE
    try:
        with path.open("rb") as file:  # a shared flock, released as the file closes: held exclusively, it fails
            fcntl.flock(file.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _held(directory, path)
    except OSError:  # no lock file (or none readable): no run holds it
        return None
    return _unlocked_holder(directory, path, {"host": socket.gethostname(), "pid": os.getpid()})


def _read(path: Path) -> dict:
    """The record of lock file `path`; {} when it is new (empty) or unreadable."""
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def lock_dirs(*directories: str | Path, command: str | None = None) -> RunLock:
    """Lock each of `directories` (created if missing; one directory named twice is locked once) for this
    process; raises DirectoryInUse naming the run that holds one, after releasing those already taken."""
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": _started(os.getpid()),
              "since": time.time(), "command": command if command is not None else " ".join(sys.argv)}
    lock = RunLock()
    try:
        for directory in dict.fromkeys(Path(d).resolve() for d in directories):
            lock._take(directory, record)
    except BaseException:
        lock.release()
        raise
    return lock
