"""`spawn` starts local ranks: each knows its GPU by LOCAL_RANK (bind_device), as under torchrun."""
from __future__ import annotations

import os

from qurl_mcore.megatron.parallel import spawn


def local_rank(rank: int) -> tuple[str | None, str | None]:
    return os.environ.get("RANK"), os.environ.get("LOCAL_RANK")


def test_spawned_ranks_have_their_local_rank():
    """N6: without LOCAL_RANK every rank of `qurl export` would bind cuda:0."""
    assert spawn(local_rank, 2) == [("0", "0"), ("1", "1")]
