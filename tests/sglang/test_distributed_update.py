"""`update_weights_from_distributed` inside the update session: a trainer rank broadcasts BF16 tensors over
a gloo group to the engine, which re-quantizes them at `end_weight_update` (SGLang 0.5.23 on CPU)."""
from __future__ import annotations

import threading

import pytest
import torch

from .conftest import checkpoint_tensors, local_engine, model_path, prompt_ids, score

pytestmark = pytest.mark.slow  # real engines, process groups or Slurm jobs: `make test`, not test-fast


def _broadcast_session(engine, group, names, tensors):
    sender = threading.Thread(target=lambda: [torch.distributed.broadcast(t, src=0, group=group) for t in tensors])
    assert engine.begin_weight_update()[0]
    sender.start()
    ok, message = engine.update_weights_from_distributed(
        names=names, dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors],
        shapes=[list(t.shape) for t in tensors], group_name="qurl-test")
    sender.join(60)
    assert ok, message
    assert engine.end_weight_update()[0]


def test_broadcast_refit_then_restore():
    from sglang.srt.utils import init_custom_process_group

    from qurl_mcore.transfer import free_port

    path = model_path("qwen3_moe")
    with local_engine(path, "qurl_int8") as rollout:
        engine = rollout.engine
        ids = prompt_ids(path)
        base = score(rollout, ids)
        port, box = free_port(), {}
        joiner = threading.Thread(target=lambda: box.update(group=init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name="qurl-test")))
        joiner.start()
        assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, "qurl-test", backend="gloo")[0]
        joiner.join(60)
        original = checkpoint_tensors(path)
        names = [k for k in original if k.endswith("proj.weight")]
        _broadcast_session(engine, box["group"], names, [original[k] * 0.5 for k in names])
        assert not torch.equal(score(rollout, ids), base)
        _broadcast_session(engine, box["group"], names, [original[k] for k in names])
        assert torch.equal(score(rollout, ids), base)
        engine.destroy_weights_update_group("qurl-test")
        torch.distributed.destroy_process_group(box["group"])
