"""The rollout client against a real SGLang HTTP server (tiny Qwen3-MoE, qurl_fp8): loopback only, an API
key, bounded timeouts, and the server is always shut down."""
from __future__ import annotations

import pytest
import requests
import torch

from qurl_mcore.models.tiny import tiny_checkpoint
from qurl_mcore.rollout import EngineConfig, HttpEngine, WeightPushError
from qurl_mcore.transfer import free_port as http_free_port

pytestmark = pytest.mark.slow  # real engines, process groups or Slurm jobs: `make test`, not test-fast

KEY = "test-key-not-a-secret"


@pytest.fixture(scope="module")
def server():
    path = str(tiny_checkpoint("qwen3_moe"))
    config = EngineConfig(path, "qurl_fp8", device="cpu", dtype="bfloat16", mem_fraction_static=0.2,
                          max_total_tokens=4096, context_length=1024, return_routed_experts=True)
    engine = HttpEngine.launch(config, api_key=KEY, startup_timeout=240, timeout=120)
    try:
        yield engine, path
    finally:
        engine.shutdown()
    assert engine.process.poll() is not None


# every endpoint a client of ours calls, and the ones that change or reveal the engine
PROTECTED = [("post", "generate"), ("get", "v1/models"), ("get", "model_info"), ("get", "get_server_info"),
             ("post", "update_weights_from_tensor"), ("post", "update_weights_from_distributed"),
             ("post", "init_weights_update_group"), ("post", "update_weights_from_disk"),
             ("post", "begin_weight_update"), ("post", "update_weight_version"), ("post", "flush_cache")]


def test_a_port_taken_before_the_server_binds_it_is_replaced(monkeypatch, tmp_path):
    """The chosen port is bound only once the model is loaded: one another process took meanwhile (held here by
    a listening socket) makes the server exit, and it is started again on another port."""
    import socket

    from qurl_mcore.rollout import http

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = [held.getsockname()[1]]
        monkeypatch.setattr(http, "free_port", lambda host: ports.pop(0) if ports else http_free_port(host))
        # the smallest start: a dense model, unquantized, without a tokenizer (the port is all this test is about)
        config = EngineConfig(str(tiny_checkpoint("llama")), None, device="cpu", dtype="bfloat16",
                              mem_fraction_static=0.2, max_total_tokens=4096, context_length=1024,
                              extra={"skip_tokenizer_init": True})
        log = tmp_path / "engine.log"
        engine = HttpEngine.launch(config, startup_timeout=240, timeout=120, log_path=str(log))
        try:
            assert not ports and not engine.url.endswith(f":{held.getsockname()[1]}")
            assert requests.get(f"{engine.url}/health", timeout=30).status_code == 200
            assert "address already in use" in log.read_text()  # the first server's exit, kept in the log
        finally:
            engine.shutdown()


def test_every_endpoint_but_health_needs_the_key(server):
    engine, _ = server
    assert engine.url.startswith("http://127.0.0.1:")
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        for method, endpoint in PROTECTED:
            r = getattr(requests, method)(f"{engine.url}/{endpoint}", json={}, headers=headers, timeout=30)
            assert r.status_code == 401, (endpoint, headers, r.status_code)
    assert requests.get(f"{engine.url}/health", timeout=30).status_code == 200  # probes need no secret
    assert engine.model_info()["weight_version"]  # the client, with the key, gets in


def test_the_key_stays_off_the_process_list_and_every_socket_is_loopback(server):
    import os

    import psutil

    engine, _ = server
    group = [p for p in psutil.process_iter() if _pgid(p.pid) == os.getpgid(engine.process.pid)]
    assert len(group) >= 2  # the HTTP server and its scheduler
    for p in group:
        assert KEY not in " ".join(p.cmdline()), p.cmdline()
        for c in p.net_connections(kind="inet"):
            if c.status == "LISTEN":
                assert c.laddr.ip == "127.0.0.1", (p.name(), c.laddr)
    assert not any(KEY in line for line in open(engine.log_path, errors="replace"))


def _pgid(pid: int) -> int | None:
    import os

    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_generate_returns_ids_logprobs_and_routed_experts(server):
    engine, _ = server
    prompts = [[1, 504, 3575, 282], [1, 17, 18]]
    outs = engine.generate(prompts, {"max_new_tokens": 5, "temperature": 1.0, "top_p": 0.9},
                           routed_experts=True)
    for g, p in zip(outs, prompts):
        assert g.prompt_ids == p and len(g.output_ids) == len(g.output_logprobs) == 5
        assert all(lp <= 0 for lp in g.output_logprobs)
        assert g.routed_experts.shape == (len(p) + 5 - 1, 2, 2)
        assert ((g.routed_experts >= 0) & (g.routed_experts < 4)).all()


def test_push_weights_with_version(server):
    from safetensors.torch import load_file

    engine, path = server
    tensors = load_file(f"{path}/model.safetensors")
    ids = [[1, 504, 3575, 282, 3575]]
    greedy = {"max_new_tokens": 6, "temperature": 0.0}
    before = engine.generate(ids, greedy)[0]
    zeroed = [(k, torch.zeros_like(v)) for k, v in tensors.items() if k.endswith("o_proj.weight")]
    assert engine.push_weights(zeroed, version="step-1", bucket_bytes=16 << 10) == 2
    changed = engine.generate(ids, greedy)[0]
    assert changed.weight_version == "step-1" and changed.output_logprobs != before.output_logprobs
    engine.push_weights(list(tensors.items()), version="step-2")
    after = engine.generate(ids, greedy)[0]
    assert (after.output_ids, after.output_logprobs) == (before.output_ids, before.output_logprobs)
    with pytest.raises(WeightPushError, match="step-3"):
        engine.check_version("step-3")


def test_released_engine_resumes_for_a_push_and_generates_the_same(server):
    """The colocated loop's cycle (rollout.offload): release everything while the trainer steps, take the
    weights back for the push (which re-quantizes them), then the KV cache and graphs for the rollout. On the
    CPU the release frees nothing (no memory saver), but the calls, the flushed cache and the re-quantization
    after them run as on a GPU."""
    from safetensors.torch import load_file

    from qurl_mcore.rollout import MEMORY_TAGS

    engine, path = server
    ids = [[1, 504, 3575, 282, 3575]]
    greedy = {"max_new_tokens": 6, "temperature": 0.0}
    before = engine.generate(ids, greedy)[0]
    engine.release_memory(MEMORY_TAGS)
    engine.resume_memory(["weights"])
    engine.push_weights(list(load_file(f"{path}/model.safetensors").items()), version="after-release")
    engine.resume_memory(["kv_cache", "cuda_graph"])
    after = engine.generate(ids, greedy)[0]
    assert after.weight_version == "after-release"
    assert (after.output_ids, after.output_logprobs) == (before.output_ids, before.output_logprobs)
