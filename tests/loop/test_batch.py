import pytest
import torch

from qurl_mcore.loop.batch import Sample, collate


def test_collate_places_responses_and_logprobs_at_their_positions():
    s1 = Sample([1, 2, 3], [7, 8], [-0.5, -1.5], reward=1.0)
    s2 = Sample([4], [9, 10, 11], [-0.1, -0.2, -0.3])
    batch = collate([s1, s2], torch.tensor([0.5, -0.5]), pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 7, 8], [4, 9, 10, 11, 0]]
    assert batch.attention_mask.tolist() == [[True] * 5, [True] * 4 + [False]]
    assert batch.response_mask.tolist() == [[False, False, False, True, True], [False, True, True, True, False]]
    assert batch.behav_logprobs.tolist() == [[0, 0, 0, -0.5, -1.5], pytest.approx([0, -0.1, -0.2, -0.3, 0])]
    assert batch.advantages.tolist() == [0.5, -0.5]
    part = batch.select(slice(1, 2)).to(torch.device("cpu"))
    assert len(part) == 1 and part.input_ids.tolist() == [[4, 9, 10, 11, 0]] and part.advantages.tolist() == [-0.5]


def test_collate_rejects_inconsistent_samples():
    with pytest.raises(ValueError, match="2 response tokens but 1 behaviour log-probs"):
        collate([Sample([1], [2, 3], [-1.0])], torch.tensor([0.0]), pad_id=0)
    with pytest.raises(ValueError, match="one advantage per sample"):
        collate([Sample([1], [2], [-1.0])], torch.tensor([0.0, 1.0]), pad_id=0)
    with pytest.raises(ValueError, match="no samples"):
        collate([], torch.tensor([]), pad_id=0)


def test_collate_places_the_engines_routing_at_the_forwarded_positions():
    import numpy as np

    # [P + R - 1 forwarded tokens, layers 2, k 2], as the engine returns them
    r1 = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 4
    r2 = np.arange(3 * 2 * 2, dtype=np.int32).reshape(3, 2, 2) % 3
    s1 = Sample([1, 2, 3], [7, 8], [-0.5, -1.5], routed_experts=r1)
    s2 = Sample([4], [9, 10, 11], [-0.1, -0.2, -0.3], routed_experts=r2)
    batch = collate([s1, s2], torch.tensor([0.5, -0.5]), pad_id=0)
    assert batch.routed_experts.shape == (2, 5, 2, 2) and batch.routed_experts.dtype == torch.int16
    assert batch.routed_experts[0, :4].tolist() == r1.tolist() and (batch.routed_experts[0, 4] == -1).all()
    assert batch.routed_experts[1, :3].tolist() == r2.tolist() and (batch.routed_experts[1, 3:] == -1).all()
    assert batch.select(slice(1, 2)).routed_experts.tolist() == batch.routed_experts[1:].tolist()
    # one sample without routing (a dense engine): none for the batch
    assert collate([s1, Sample([4], [9], [-0.1])], torch.tensor([0.0, 0.0]), pad_id=0).routed_experts is None
    with pytest.raises(ValueError, match=r"sample 0: routed experts \(3, 2, 2\) for 4 forwarded tokens"):
        collate([Sample([1, 2, 3], [7, 8], [-0.5, -1.5], routed_experts=r1[:3])], torch.tensor([0.0]), pad_id=0)
