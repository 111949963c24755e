import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from qurl_mcore.rl.advantages import dynamic_sampling_mask, grpo_advantages, rloo_advantages


def test_grpo_by_hand():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt((4·0.25)/3) = 1/sqrt(3)
    # group [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.5625 + 3·0.0625)/3) = 0.5
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    got = grpo_advantages(rewards, eps=0.0)
    s = math.sqrt(3) / 2
    np.testing.assert_allclose(got.numpy(), [[s, -s, -s, s], [1.5, -0.5, -0.5, -0.5]], rtol=1e-6)
    # eps is added to the std
    assert grpo_advantages(rewards, eps=0.5)[1].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_dr_grpo_drops_the_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    got = grpo_advantages(rewards, scale_by_std=False)
    np.testing.assert_allclose(got.numpy(), [[0.5, -0.5, -0.5, 0.5], [0.75, -0.25, -0.25, -0.25]], rtol=1e-6)


def test_rloo_by_hand():
    # A_i = r_i − mean of the others: [1, 0, 0, 0] → [1 − 0, 0 − 1/3, 0 − 1/3, 0 − 1/3]
    got = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 6.0, 8.0]]))
    # second group: 2 − 6 = −4, 4 − 16/3, 6 − 14/3, 8 − 4
    want = [[1.0, -1 / 3, -1 / 3, -1 / 3], [-4.0, 4 - 16 / 3, 6 - 14 / 3, 4.0]]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_equal_rewards_give_zero_advantage_not_nan():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert grpo_advantages(rewards).tolist() == [[0.0] * 3] * 2
    assert rloo_advantages(rewards).tolist() == [[0.0] * 3] * 2


# Mostly verifier-like rewards (many ties, so some groups are all-equal), sometimes arbitrary ones.
reward = st.sampled_from([0.0, 0.5, 1.0]) | st.floats(-5, 5)
group_rewards = st.integers(1, 4).flatmap(
    lambda g: st.integers(2, 6).flatmap(
        lambda n: st.lists(st.lists(reward, min_size=n, max_size=n), min_size=g, max_size=g)
    )
)


@settings(max_examples=80, deadline=None)
@given(rows=group_rewards)
def test_against_closed_forms_and_flat_layout(rows):
    rewards = torch.tensor(rows, dtype=torch.float64)
    r = np.array(rows)
    n = r.shape[1]
    mean = r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, ddof=1, keepdims=True)
    np.testing.assert_allclose(grpo_advantages(rewards, eps=1e-6).numpy(), (r - mean) / (std + 1e-6), atol=1e-9)
    np.testing.assert_allclose(grpo_advantages(rewards, scale_by_std=False).numpy(), r - mean, atol=1e-12)
    loo = np.array([[row[i] - np.delete(row, i).mean() for i in range(n)] for row in r])
    np.testing.assert_allclose(rloo_advantages(rewards).numpy(), loo, atol=1e-12)
    np.testing.assert_array_equal(dynamic_sampling_mask(rewards).numpy(), [len(set(row)) > 1 for row in rows])
    # the flat layout gives the same numbers in the flat shape
    flat = rewards.flatten()
    for fn in (grpo_advantages, rloo_advantages):
        assert torch.equal(fn(flat, group_size=n), fn(rewards).flatten())
    assert torch.equal(dynamic_sampling_mask(flat, group_size=n), dynamic_sampling_mask(rewards))


def test_dynamic_sampling_by_hand():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    keep = dynamic_sampling_mask(rewards, group_size=2)
    assert keep.tolist() == [False, True, False, False]
    assert keep.nonzero().squeeze(-1).tolist() == [1]


def test_integer_rewards_are_accepted():
    got = grpo_advantages(torch.tensor([[1, 0]]), scale_by_std=False)
    assert got.dtype == torch.float32 and got.tolist() == [[0.5, -0.5]]


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages, dynamic_sampling_mask])
@pytest.mark.parametrize(
    "rewards, group_size, message",
    [
        (torch.zeros(6), None, r"\[num_groups, n\]"),
        (torch.zeros(7), 2, "multiple of group_size"),
        (torch.zeros(2, 3), 3, "1-D"),
        (torch.zeros(4, 1), None, "at least 2 responses"),
        (torch.zeros(4), 1, "at least 2 responses"),
        (torch.tensor([[0.0, math.nan]]), None, "NaN or inf"),
    ],
)
def test_bad_rewards_raise(fn, rewards, group_size, message):
    with pytest.raises(ValueError, match=message):
        fn(rewards, group_size)
