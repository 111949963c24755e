"""Rollout client pieces that need no engine: engine arguments, response parsing."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from qurl_mcore.rollout import EngineConfig
from qurl_mcore.rollout.results import parse


def test_engine_config_renders_quantization_and_cpu_settings():
    cfg = EngineConfig("/m", "qurl_fp4_rc", {"fmt": "mxfp4", "scope": "experts"}, device="cpu",
                       return_routed_experts=True, max_total_tokens=4096)
    kw = cfg.engine_kwargs()
    assert kw["quantization"] == "qurl_fp4_rc" and kw["enable_return_routed_experts"] is True
    assert json.loads(kw["json_model_override_args"])["quantization_config"] == {
        "quant_method": "qurl_fp4_rc", "fmt": "mxfp4", "scope": "experts", "kernel": "auto", "master": "host",
        "requant": "eager", "push": "bf16"}
    assert kw["attention_backend"] == "torch_native" and cfg.environment() == {"SGLANG_USE_CPU_ENGINE": "1"}
    argv = cfg.server_argv("127.0.0.1", 30000, config_file="/private/server.yaml")
    assert argv[:6] == ["--host", "127.0.0.1", "--port", "30000", "--config", "/private/server.yaml"]
    assert not any("api" in a for a in argv)
    assert "--enable-return-routed-experts" in argv and "--skip-server-warmup" in argv
    assert argv[argv.index("--max-total-tokens") + 1] == "4096"
    with pytest.raises(ValueError, match="fmt"):
        EngineConfig("/m", "qurl_fp4", {"fmt": "int4"}).engine_kwargs()
    with pytest.raises(ValueError, match="without a qurl"):
        EngineConfig("/m", None, {"fmt": "mxfp4"}).engine_kwargs()


def test_parse_response_with_prompt_logprobs_and_routed_experts():
    routed = np.arange(3 * 2 * 2, dtype=np.int32)
    out = {"text": "ab", "meta_info": {
        "input_token_logprobs": [(None, 5, None), (-1.5, 6, None)],
        "output_token_logprobs": [(-0.25, 7, None), (-0.5, 8, None)],
        "finish_reason": {"type": "length"}, "weight_version": "v3",
        "routed_experts": base64.b64encode(routed.tobytes()).decode()}}
    g = parse(out, [5, 6], moe_shape=(2, 2))
    assert g.output_ids == [7, 8] and g.output_logprobs == [-0.25, -0.5] and g.prompt_logprobs == [-1.5]
    assert g.weight_version == "v3" and g.routed_experts.shape == (3, 2, 2)
    assert g.routed_experts[2, 1, 0] == routed.reshape(3, 2, 2)[2, 1, 0]


def test_an_api_key_that_reads_as_an_option_is_refused_before_a_server_starts():
    """SGLang reads the key file as command-line arguments: a key beginning with '-' would be taken for an
    option (the server then exits with a usage error; one in 64 URL-safe keys did). The loop's keys are hex."""
    import string

    from qurl_mcore.loop.sampler import new_api_key
    from qurl_mcore.rollout.http import HttpEngine

    with pytest.raises(ValueError, match="must not begin with '-'"):
        HttpEngine.launch(EngineConfig("/nonexistent"), api_key="-3xYz")
    keys = {new_api_key() for _ in range(1000)}
    assert len(keys) == 1000 and all(len(k) == 64 and set(k) <= set(string.hexdigits) for k in keys)


def _sglang_error_body(message: str) -> dict:
    """The body SGLang 0.5.23's /generate answers (HTTP 400) for a request its tokenizer manager refuses."""
    from sglang.srt.entrypoints.http_server import _create_error_response

    return json.loads(_create_error_response(ValueError(message)).body)


def test_a_prompt_longer_than_the_context_is_the_requests_error_not_a_crash():
    """SGLang refuses the whole /generate call with {"error": {"message": ...}}; parsing it used to fail with
    `TypeError: string indices must be integers`, which the loop took for an engine crash and restarted."""
    from qurl_mcore.rollout.results import RequestRefused, parse_batch

    body = _sglang_error_body("The input (2100 tokens) is longer than the model's context length (2048 tokens).")
    assert body == {"error": {"message": "The input (2100 tokens) is longer than the model's context length "
                                         "(2048 tokens)."}}
    with pytest.raises(RequestRefused, match=r"refused 2 prompt\(s\) \(the longest, #1, has 2100 tokens\): The "
                                             r"input \(2100 tokens\) is longer than the model's context length"):
        parse_batch(body, [[1] * 10, [1] * 2100], None)


def test_a_request_the_scheduler_aborts_names_that_prompt():
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from qurl_mcore.rollout.results import RequestRefused, parse_batch

    good = {"text": "a", "meta_info": {"output_token_logprobs": [(-0.5, 7, None)], "finish_reason": {"type": "stop"}}}
    reason = FINISH_ABORT("Input length (5000 tokens) exceeds the maximum allowed length (4096 tokens).").to_json()
    aborted = {"text": "", "meta_info": {"finish_reason": reason}}
    assert [g.output_ids for g in parse_batch([good], [[1, 2]], None)] == [[7]]
    with pytest.raises(RequestRefused, match=r"prompt #1 \(5000 tokens\): Input length \(5000 tokens\) exceeds"):
        parse_batch([good, aborted], [[1, 2], [1] * 5000], None)


def test_a_nan_log_prob_is_named_as_such():
    """SGLang's JSON carries a NaN log-prob as null: the prompt and token are named, not a TypeError of float()."""
    import json

    from qurl_mcore.rollout.results import NonFiniteLogprobs, parse_batch

    good = {"text": "a", "meta_info": {"output_token_logprobs": [(-0.5, 7, None)], "finish_reason": None}}
    nan = json.loads(json.dumps({"text": "b", "meta_info": {"output_token_logprobs": [[-0.1, 3, None], [None, 4, None]],
                                                            "finish_reason": None}}))
    with pytest.raises(NonFiniteLogprobs, match=r"prompt #1: the engine returned 1 non-finite log-prob\(s\) of 2 "
                                                r"for the output tokens, the first at token 1 \(nan\)"):
        parse_batch([good, nan], [[1], [2]], None)
    prompt_zero = {"text": "c", "meta_info": {"output_token_logprobs": [(-0.5, 7, None)], "finish_reason": None,
                                              "input_token_logprobs": [(None, 1, None), (float("-inf"), 2, None)]}}
    assert parse_batch([prompt_zero], [[1, 2]], None)[0].prompt_logprobs == [float("-inf")]  # probability 0: kept


def test_a_refused_request_is_no_engine_failure_to_restart():
    """The rollout manager passes a refusal through (the driver ends the run naming it) instead of an
    EngineFailure, which would restart the engine and retry the same prompt."""
    from qurl_mcore.loop.sampler import EngineFailure, RolloutManager
    from qurl_mcore.rollout.results import RequestRefused

    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # not a `ray start` head

    @ray.remote
    def refuse():
        raise RequestRefused("the engine refused prompt #0 (9000 tokens): too long")

    @ray.remote
    def crash():
        raise RuntimeError("engine died")

    try:
        with pytest.raises(RequestRefused, match="prompt #0"):
            RolloutManager._gather(None, {0: refuse.remote()})
        with pytest.raises(EngineFailure, match="rollout engine 3 failed"):
            RolloutManager._gather(None, {3: crash.remote()})
    finally:
        ray.shutdown()
