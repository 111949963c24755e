"""A trainer's micro-batch computes its loss and metrics without reading values back to the host
(`policy_loss(..., on_device=True)`), with the same values the host-read form gives."""
import math

import pytest
import torch

from qurl_mcore.rl import AGGREGATIONS, LOSSES
from qurl_mcore.rl.losses import aggregation_units, policy_loss
from tests.host_syncs import HostReads


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 7)
    lp = (-3 * torch.rand(shape, generator=g, dtype=torch.float64)).requires_grad_()
    prox = lp.detach() + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
    behav = prox + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) > 0.3
    mask[2] = False  # an empty sequence
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    ref = prox + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
    entropy = torch.rand(shape, generator=g, dtype=torch.float64).requires_grad_()
    return lp, prox, behav, adv, mask, ref, entropy


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("method", LOSSES)
def test_on_device_loss_reads_nothing_back_and_matches(method, agg):
    lp, prox, behav, adv, mask, ref, entropy = _inputs()
    kw = dict(method=method, agg=agg, ref_logprobs=ref, kl_coef=0.1, entropy=entropy, entropy_coef=0.01)
    with HostReads() as reads:
        loss_d, metrics_d = policy_loss(lp, prox, behav, adv, mask, on_device=True, **kw)
        units = aggregation_units(mask, agg)
    assert reads.count == 0, reads.ops
    with HostReads() as reads:
        loss, metrics = policy_loss(lp, prox, behav, adv, mask, **kw)
    assert reads.count >= 15  # the host-read form: one or more per metric and check
    assert metrics.keys() == metrics_d.keys()
    for k, v in metrics.items():
        assert isinstance(metrics_d[k], torch.Tensor) and not metrics_d[k].requires_grad
        assert float(metrics_d[k]) == pytest.approx(v, rel=1e-12, abs=1e-15, nan_ok=True), k
    assert float(loss_d.detach()) == pytest.approx(float(loss.detach()), rel=1e-12)
    assert int(units) == {"token_mean": int(mask.sum()), "seq_mean_token_mean": 2, "seq_mean_token_sum": 3}[agg]
    grad, = torch.autograd.grad(loss, lp)
    grad_d, = torch.autograd.grad(loss_d, lp)
    torch.testing.assert_close(grad_d, grad, rtol=1e-12, atol=1e-15)


def test_on_device_loss_turns_non_finite_inputs_into_nan_instead_of_raising():
    lp, prox, behav, adv, mask, _, _ = _inputs()
    behav = behav.clone()
    behav[mask.nonzero()[0].tolist()] = -math.inf
    with pytest.raises(ValueError, match="non-finite"):
        policy_loss(lp, prox, behav, adv, mask, method="tis")
    loss, metrics = policy_loss(lp, prox, behav, adv, mask, method="tis", on_device=True)
    assert not math.isfinite(float(metrics["mismatch/kl_k1"]))
