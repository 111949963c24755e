"""Padding a training batch's width: the rule (`width_multiple`: TP for sequence parallelism, ×16 tokens for
FP8 on Transformer Engine), and that the real trainer's update on a padded batch is that of the unpadded one."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from qurl_mcore.loop.trainer import width_multiple

from .test_trainer import _batch, _grads, _trainer


@pytest.mark.parametrize("tp, te, multiple", [(1, False, 1), (2, False, 2), (1, True, 16), (2, True, 32),
                                              (8, True, 128)])
def test_width_multiple(tp, te, multiple):
    assert width_multiple(tp, te) == multiple


@pytest.mark.parametrize("width, tp, padded", [(10, 1, 16), (16, 1, 16), (17, 1, 32), (33, 2, 64), (64, 2, 64),
                                               (100, 4, 128)])
def test_te_widths_give_every_rank_a_multiple_of_16_tokens(width, tp, padded):
    """Hand-derived padded widths; each rank's tokens (width/TP per row under sequence parallelism) are a
    multiple of 16 for any number of rows in a micro-batch, as TE's FP8 GEMMs need."""
    assert width + (-width % width_multiple(tp, True)) == padded
    assert all(padded // tp * rows % 16 == 0 for rows in range(1, 9))


def test_a_batch_padded_for_te_gives_the_update_of_the_unpadded_one():
    """The same trainer and batch, once with the width padded as TE FP8 needs (its recipe says TE; the
    tiny model itself runs on the CPU), once unpadded: same loss and gradients up to fp32 rounding, and no
    query row of any attention mask the trainer builds is fully masked."""
    trainer = _trainer("train.micro_batch_size=4")
    try:
        batch = _batch(trainer, behav_from_model=False)
        assert batch.input_ids.shape[1] % 16  # the batch needs padding for TE
        assert trainer._pad_width(batch) is batch  # TP 1 without TE: nothing to pad
        plain = trainer.step(batch)
        grads = _grads(trainer)
    finally:
        trainer.close()
    trainer = _trainer("train.micro_batch_size=4")
    trainer.recipe = dataclasses.replace(trainer.recipe, te=True)
    try:
        padded_batch = trainer._pad_width(batch)
        assert padded_batch.input_ids.shape[1] == 16
        width = batch.input_ids.shape[1]
        for pad in (padded_batch.attention_mask, padded_batch.response_mask):
            assert not pad[:, width:].any()
        masks = []  # the attention masks of the trainer's forwards: no query row may be fully masked (cuDNN)
        hook = trainer.model.register_forward_pre_hook(lambda module, args: masks.append(args[2]))
        padded = trainer.step(batch)
        hook.remove()
        padded_grads = _grads(trainer)
    finally:
        trainer.close()
    assert masks and all(m.shape[-1] == 16 and (~m).any(-1).all() for m in masks)
    assert padded["train/skipped_nonfinite"] == plain["train/skipped_nonfinite"] == 0.0
    for key in ("loss/policy", "train/grad_norm", "is_ratio/mean", "train/response_tokens"):
        assert padded[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    for name, g in grads.items():
        torch.testing.assert_close(padded_grads[name], g, rtol=1e-4, atol=1e-7)
