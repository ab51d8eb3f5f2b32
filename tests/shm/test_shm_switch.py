"""The shared-memory path can be switched off per communicator (and so per runtime)."""

import inspect

import numpy as np
import pytest

import collectives
from runtime.sharedmem.segments import shm_usable
from runtime.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("enabled", [True, False])
async def test_runtime_switch_decides_the_path(enabled, tmp_path):
    async def body(w):
        w.runtime.shm_enabled = enabled
        w.runtime.tracer.out_dir = str(tmp_path)  # record calls, with their algorithm
        x = np.full(5, w.rank + 1, np.float32)
        await collectives.all_reduce(x, group=w)
        assert (x == 1 + 2 + 3).all()
        sub = w.new_group([0, 2])
        assert sub.shm_enabled == enabled  # sub-groups follow their runtime
        return w.runtime.tracer.events[-1]["args"]["algorithm"], shm_usable()  # (one host)

    results = await run_ranks(3, body, transport="tcp")
    for algorithm, available in results:
        if enabled and available:
            assert algorithm == "shm"
        if not enabled:
            assert algorithm == "recursive_doubling"  # the table's choice without shared memory


def test_communicator_has_the_option():
    assert "shm" in inspect.signature(collectives.Communicator.__init__).parameters
