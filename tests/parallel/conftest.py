"""One BLAS thread while these tests train: ranks run as threads of one process on a
2-core machine, and OpenBLAS threads fighting over the cores make small matmuls far slower."""

import pytest
from threadpoolctl import threadpool_limits  # a dependency of scikit-learn


@pytest.fixture(autouse=True)
def _one_blas_thread():
    with threadpool_limits(limits=1, user_api="blas"):
        yield
