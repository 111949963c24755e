"""Run by tests/integrations/test_slime.py as `python -m tests.integrations.slime_sglang` with slime's SGLang
(0.5.15.post1) first on the path: for each case, a CPU engine with our plugin scores a greedy sequence at load
and after each of four pushes, every bucket re-quantized on arrival (qurl_mcore/sglang/session.py), in the three
ways slime pushes: noisy layer-0 weights as tensors, the originals back as flattened buckets, the noisy weights
again over a gloo weight group, the originals again as tensors.
Prints one line `RESULT <json>`; the test compares it with the independent reference."""
from __future__ import annotations

import json
import threading
import time

import torch

CASES = [("qwen3_moe", "qurl_int8", {"scope": "all"}), ("qwen3_moe", "qurl_fp4_rc", {"fmt": "mxfp4"})]


def flush(engine, attempts: int = 200) -> None:
    """The cache flush slime makes after a push (its engine's `flush_cache`, retried until the scheduler has no
    request left): slime's pushes pass flush_cache=False, because SGLang 0.5.15 asserts in the scheduler, and
    the scheduler dies, when a flush asked with an update finds a request still in its running batch (the overlap
    loop retires a finished request one iteration late)."""
    for _ in range(attempts):
        if engine.flush_cache().success:
            return
        time.sleep(0.05)
    raise AssertionError(f"the cache was not flushed in {attempts} attempts")


def push(engine, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
    """One `update_weights_from_tensor` call per bucket, the call slime's colocated push makes (no session:
    SGLang 0.5.15 has none), then slime's flush."""
    for bucket in buckets:
        ok, message = engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
        assert ok, message
    flush(engine)


def push_flattened(engine, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
    """slime's colocated push as slime sends it (update_weight_from_tensor.py:30-48, 384-421 at 624b824a): each
    bucket one `FlattenedTensorBucket` of mixed dtypes, serialized per TP rank, load format `flattened_bucket`."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    for bucket in buckets:
        flat = FlattenedTensorBucket(named_tensors=bucket)
        data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
        ok, message = engine.update_weights_from_tensor(
            named_tensors=[MultiprocessingSerializer.serialize(data, output_str=True)],
            load_format="flattened_bucket", flush_cache=False)
        assert ok, message
    flush(engine)


def push_distributed(engine, buckets: list[list[tuple[str, torch.Tensor]]], group_name: str) -> None:
    """slime's disaggregated push (update_weight_from_distributed.py:285-353): the engine joins a weight group
    with the trainer's rank 0 (gloo here, NCCL on GPUs); per bucket, the engine's `update_weights_from_distributed`
    receives what rank 0 broadcasts at the same time, one broadcast a tensor as slime sends them."""
    from qurl_mcore.rollout.broadcast import WeightSender
    from qurl_mcore.transfer import free_port

    port = free_port()
    results: list = []

    def engine_side(call, **kwargs) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.append(getattr(engine, call)(**kwargs)))
        thread.start()
        return thread

    join = engine_side("init_weights_update_group", master_address="127.0.0.1", master_port=port, rank_offset=1,
                       world_size=2, group_name=group_name, backend="gloo")
    sender = WeightSender.connect(2, "127.0.0.1", port, group_name=group_name, backend="gloo", timeout=300)
    join.join()
    for bucket in buckets:
        receive = engine_side("update_weights_from_distributed", names=[n for n, _ in bucket],
                              dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                              shapes=[list(t.shape) for _, t in bucket], group_name=group_name, flush_cache=False)
        for work in [torch.distributed.broadcast(t, src=0, group=sender.group, async_op=True) for _, t in bucket]:
            work.wait()
        receive.join()
    sender.close()
    results.append(engine.destroy_weights_update_group(group_name))
    assert all(ok for ok, _ in results), results
    flush(engine)


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
            back = list(original.items())
            scores = {"base": base}
            push(engine.engine, [changed[i::3] for i in range(3)])  # three buckets, as slime sends them
            scores["noisy"] = score(engine, seq)
            push_flattened(engine.engine, [back[i::2] for i in range(2)])
            scores["restored_flattened"] = score(engine, seq)
            push_distributed(engine.engine, [changed[i::2] for i in range(2)], f"slime-{method}")
            scores["noisy_distributed"] = score(engine, seq)
            push(engine.engine, [back])
            scores["restored"] = score(engine, seq)
        cases.append({"model": model, "method": method, "options": options, "seq": seq,
                      **{k: v.tolist() for k, v in scores.items()}})
    print("RESULT " + json.dumps({"sglang": sglang.__version__, "cases": cases}), flush=True)


if __name__ == "__main__":
    main()
