"""`HttpEngine`: an SGLang HTTP server, started here (bound to 127.0.0.1 by default) or attached to by URL.

Weight pushes send tensors the way SGLang's own HTTP adapter does: the JSON request carries torch
multiprocessing handles to the pushing process's memory, so pusher and server must share a host (the
colocated RL layout). Across hosts, push through `update_weights_from_distributed` instead.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import requests
import torch.multiprocessing as mp

from qurl_mcore.parent_death import with_parent_death
from qurl_mcore.transfer import free_port

from .engine_config import EngineConfig
from .engine import RolloutEngine


class HttpEngine(RolloutEngine):
    """Requests go to `url` with `Authorization: Bearer <api_key>` when a key is set; each has a timeout."""

    def __init__(self, config: EngineConfig, url: str, *, api_key: str | None = None, timeout: float = 600.0,
                 process: subprocess.Popen | None = None, log_path: str | None = None):
        super().__init__(config)
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.process = process
        self.log_path = log_path
        self.owns_log = False  # a temporary log this object removes at shutdown
        self.api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    #: servers started on a port of our choosing before giving up on finding one that stays free
    PORT_ATTEMPTS = 3

    @classmethod
    def launch(cls, config: EngineConfig, *, host: str = "127.0.0.1", port: int | None = None,
               api_key: str | None = None, startup_timeout: float = 300.0, timeout: float = 600.0,
               env: dict[str, str] | None = None, log_path: str | None = None) -> "HttpEngine":
        """Start `python -m sglang.launch_server` in its own process group, with `env` added to its
        environment and SIGKILL for it when this process dies (`qurl_mcore.parent_death`), and wait until it
        serves. Its output goes to the end of `log_path`, which stays; by
        default to a temporary file, removed at shutdown unless the server failed.

        Without `port`, one that is free is chosen; the server binds it only once its model is loaded, tens of
        seconds later, and a port another process took meanwhile (an outgoing connection, a Ray worker) makes
        it exit: it is started again on another, up to PORT_ATTEMPTS times.

        `api_key` reaches the server in a YAML file only its owner can read (never on the command line,
        where every user of the machine sees it), removed once the server has read it."""
        if api_key and api_key.startswith("-"):  # SGLang turns the file into command-line arguments
            raise ValueError("api_key must not begin with '-': SGLang's argument parser would take it for an "
                             "option and the server would not start; use e.g. secrets.token_hex(32)")
        owns_log = not log_path
        if owns_log:
            with tempfile.NamedTemporaryFile("w", prefix="qurl-sglang-", suffix=".log", delete=False) as log:
                log_path = log.name
        attempts = 1 if port else cls.PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            with open(log_path, "a") as log:  # where this attempt's output begins
                offset = log.tell()
            try:
                engine = cls._start(config, host, port or free_port(host), api_key, startup_timeout, timeout, env,
                                    log_path)
            except RuntimeError:
                with open(log_path, errors="replace") as log:
                    log.seek(offset)
                    taken = "address already in use" in log.read()
                if attempt == attempts or not taken:
                    raise
                continue
            engine.owns_log = owns_log
            return engine

    @classmethod
    def _start(cls, config: EngineConfig, host: str, port: int, api_key: str | None, startup_timeout: float,
               timeout: float, env: dict[str, str] | None, log_path: str) -> "HttpEngine":
        """One server on `port`, its output appended to `log_path`, waited for until it serves."""
        secret_dir = tempfile.mkdtemp(prefix="qurl-engine-")  # mode 0700
        config_file = None
        if api_key:
            config_file = os.path.join(secret_dir, "server.yaml")
            fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"api-key: {json.dumps(api_key)}\n")
        # killed with this process (an OOM-killed engine host), or it would keep its GPU memory and port
        argv = with_parent_death([sys.executable, "-m", "sglang.launch_server",
                                  *config.server_argv(host, port, config_file)])
        with open(log_path, "a") as log:  # the server holds its own descriptor
            process = subprocess.Popen(argv, env={**os.environ, **config.environment(), **(env or {})},
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        engine = cls(config, f"http://{host}:{port}", api_key=api_key, timeout=timeout, process=process,
                     log_path=log_path)
        try:
            engine._wait_ready(startup_timeout)
        except BaseException:
            engine.shutdown(keep_log=True)  # the error names the log
            raise
        finally:
            shutil.rmtree(secret_dir, ignore_errors=True)
        return engine

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {self.process.returncode}; log: {self.log_path}")
            try:
                if requests.get(f"{self.url}/health", headers=self._headers, timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"SGLang server at {self.url} not ready after {timeout:.0f} s; log: {self.log_path}")

    def _post(self, endpoint: str, payload: dict):
        r = requests.post(f"{self.url}/{endpoint}", json=payload, headers=self._headers, timeout=self.timeout)
        if r.status_code == 400:  # SGLang reports refused control calls as 400 with {"success": false, ...}
            return r.json()
        r.raise_for_status()
        return r.json()

    def _generate(self, input_ids, sampling, extra):
        return self._post("generate", {"input_ids": input_ids, "sampling_params": sampling, **extra})

    def _control(self, call, **kwargs):
        if call == "update_weights_from_tensor":
            # SGLang's serializer only where weights go by CUDA IPC: the client imports without SGLang
            from sglang.srt.utils import MultiprocessingSerializer

            # CPU storages travel as named shared-memory files: the default (file descriptors handed over by
            # multiprocessing's resource sharer) authenticates with our process's key, which a server we did
            # not fork does not hold. CUDA tensors travel as CUDA IPC handles either way.
            previous = mp.get_sharing_strategy()
            mp.set_sharing_strategy("file_system")
            try:
                payload = MultiprocessingSerializer.serialize(kwargs.pop("named_tensors"), output_str=True)
            finally:
                mp.set_sharing_strategy(previous)
            kwargs["serialized_named_tensors"] = [payload] * int(self.config.extra.get("tp_size", 1))
        return self._post(call, kwargs)

    def model_info(self) -> dict:
        r = requests.get(f"{self.url}/model_info", headers=self._headers, timeout=self.timeout)
        r.raise_for_status()
        return r.json()

    def shutdown(self, keep_log: bool = False) -> None:
        """Stop a server this object launched (its whole process group) and remove its log unless asked to
        keep it; an attached server keeps running."""
        if self.process is None:
            return
        # The whole group, even when the server itself already died: its workers may live on. SIGKILL at once,
        # as SGLang's own kill_process_tree does: nothing is in flight when an engine is stopped (the run ended,
        # or the engine is replaced), and its SIGTERM path only notices the request after a 5 s poll.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        if self.log_path and self.owns_log and not keep_log:
            os.unlink(self.log_path)
            self.log_path = None
