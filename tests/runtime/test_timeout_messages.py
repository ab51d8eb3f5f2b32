"""A collective's timeout says in words which ranks it waited on and which had not come: no
empty lists, no Python lists at all ("waiting on rank(s) []; rank(s) [1] had not reached this
call" was the message of a shared-memory call, which waits on no rank's frames)."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from runtime.errors import CollectiveTimeoutError, ranks_in_words
from runtime.testing import run_ranks

pytestmark = pytest.mark.timeout(30)


def test_ranks_in_words():
    assert ranks_in_words([1]) == "rank 1"
    assert ranks_in_words([1, 0]) == "ranks 0 and 1"
    assert ranks_in_words([7, 0, 5, 6, 2, 2]) == "ranks 0, 2 and 5-7"
    assert ranks_in_words([]) == "no rank"


@pytest.mark.parametrize("algorithm", ["shm", "ring"])
async def test_a_rank_that_never_comes_is_named_in_words(algorithm):
    async def body(g):
        if g.rank == 1:
            return None  # never makes the call
        try:
            await C.all_reduce(np.ones(8, np.float32), timeout=1.0, algorithm=algorithm)
        except CollectiveTimeoutError as exc:
            return str(exc)
        return "finished"

    said = await run_ranks(3, body)
    for r in (0, 2):
        assert "rank 1 had not reached this call (1: " in said[r], said[r]
        assert "[" not in said[r] and "rank(s)" not in said[r], said[r]
