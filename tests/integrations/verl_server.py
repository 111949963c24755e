"""verl 0.9.1's SGLang rollout modules as `qurl patch apply --target verl` leaves them, loaded from a patched copy
of the installed files (the venv's verl stays as published), and verl's SGLang server run in a process of its
own, as verl's Ray actor runs it, with the same patches applied at import instead:

    VERL_USE_EXTERNAL_MODULES=qurl_mcore.integrations.verl_rollout python -m tests.integrations.verl_server \
        MODEL_PATH SGLANG_KWARGS_JSON

launches the server (`SGLangHttpServer.launch_server`, HYBRID mode, on 127.0.0.1), prints `PORT <port>` and serves
until killed; its SGLang processes share its process group. A process of its own, not the test's: SGLang's
tokenizer side, which verl runs in the server's process, takes the end of its engine processes for a crash and
kills the process it runs in.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

ROLLOUT = "verl.workers.rollout.sglang_rollout."
PATCHED = ("http_server_engine", "sglang_rollout", "async_sglang_server")  # each imports the one before


def patched_rollout(site: Path, register: Callable[[str, object], None]) -> SimpleNamespace:
    """The PATCHED modules from `site` (a copy of site-packages holding them), each handed to `register(name,
    module)` (e.g. a sys.modules setter) before it runs, so that the next one imports it."""
    modules = {}
    for name in PATCHED:
        spec = importlib.util.spec_from_file_location(ROLLOUT + name, site / f"{(ROLLOUT + name).replace('.', '/')}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        register(ROLLOUT + name, modules[name])
        spec.loader.exec_module(modules[name])
    return SimpleNamespace(**modules)


def sglang_server(rollout_modules: SimpleNamespace, sglang_kwargs: dict, model_path: str):
    """verl's SGLangHttpServer of one single-GPU replica in HYBRID mode (verl's colocated default), with
    `actor_rollout_ref.rollout.engine_kwargs.sglang` = `sglang_kwargs`."""
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutMode

    rollout = RolloutConfig(name="sglang", tensor_model_parallel_size=1, engine_kwargs={"sglang": sglang_kwargs})
    return rollout_modules.async_sglang_server.SGLangHttpServer(
        rollout, HFModelConfig(path=model_path), RolloutMode.HYBRID, workers=[], replica_rank=0, node_rank=0,
        nnodes=1, cuda_visible_devices="", base_gpu_id=0)


async def serve(model_path: str, sglang_kwargs: dict) -> None:
    import verl.workers.rollout.sglang_rollout.async_sglang_server as module  # patched by the hook, if loaded

    from qurl_mcore.integrations.verl_rollout import PatchedSourceLoader

    if not isinstance(module.__spec__.loader, PatchedSourceLoader):
        raise SystemExit("verl's rollout was imported unpatched: set VERL_USE_EXTERNAL_MODULES="
                         "qurl_mcore.integrations.verl_rollout")
    server = sglang_server(SimpleNamespace(async_sglang_server=module), sglang_kwargs, model_path)
    server._server_address = "127.0.0.1"  # verl listens on Ray's node address; tests stay on loopback
    await server.launch_server()
    print(f"PORT {server.get_server_address()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], json.loads(sys.argv[2])))
