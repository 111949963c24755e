"""Run by tests/integrations/test_slime.py as `python -m tests.integrations.slime_sglang` with slime's SGLang
(0.5.15.post1) first on the path: for each case, a CPU engine with our plugin scores a greedy sequence at load,
after a partial push of noisy layer-0 weights in three buckets (each re-quantized on arrival:
qurl_mcore/sglang/session.py) and after pushing the originals back.
Prints one line `RESULT <json>`; the test compares it with the independent reference."""
from __future__ import annotations

import json

import torch

CASES = [("qwen3_moe", "qurl_int8", {"scope": "all"}), ("qwen3_moe", "qurl_fp4_rc", {"fmt": "mxfp4"})]


def push(engine, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
    """One `update_weights_from_tensor` call per bucket, the call slime's colocated push makes (no session:
    SGLang 0.5.15 has none)."""
    for bucket in buckets:
        ok, message = engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=True)
        assert ok, message


def main() -> None:
    import sglang

    from tests.sglang.conftest import checkpoint_tensors, local_engine, model_path, noisy_layer0, prompt_ids, score

    cases = []
    for model, method, options in CASES:
        path = model_path(model)
        original = checkpoint_tensors(path)
        noisy = noisy_layer0(original)
        with local_engine(path, method, options) as engine:
            ids = prompt_ids(path)
            seq = ids + engine.generate([ids], {"max_new_tokens": 8, "temperature": 0.0})[0].output_ids
            base = score(engine, seq)
            changed = [(k, v) for k, v in noisy.items() if v is not original[k]]
            push(engine.engine, [changed[i::3] for i in range(3)])  # three buckets, as slime sends them
            after = score(engine, seq)
            push(engine.engine, [list(original.items())])
            restored = score(engine, seq)
        cases.append({"model": model, "method": method, "options": options, "seq": seq, "base": base.tolist(),
                      "noisy": after.tolist(), "restored": restored.tolist()})
    print("RESULT " + json.dumps({"sglang": sglang.__version__, "cases": cases}), flush=True)


if __name__ == "__main__":
    main()
