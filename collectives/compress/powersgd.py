"""PowerSGD codec: rank-r approximation M ~ P Q^T with a warm-started Q.

One step of power iteration per call (Vogels, Karimireddy, Jaggi, NeurIPS 2019, Algorithm 1), for a
gradient viewed as a matrix M (n, m) = (shape[0], prod(shape[1:])):

    P = M Q                 (n, r)   compute_p
    all_reduce(P, avg)               <- the collective
    P = orthonormalize(P)            after_p_allreduce (Gram-Schmidt)
    Q = M^T P               (m, r)   compute_q, Q is the state
    all_reduce(Q, avg)               <- the collective, in place on the state
    M_hat = P Q^T           (n, m)   decompress

Every rank starts from the same Q (seeded normal, per ``key``), so the all-reduced P and Q are the
ones a single process would compute on the averaged gradient; Q is kept between steps, the warm
start that makes one iteration per step enough. Use with ``ErrorFeedback`` (the paper does).

Error bound: P's columns are orthonormal or zero, so M_hat = P P^T M is the orthogonal projection of
M onto span(P): ||M - M_hat||_F <= ||M||_F always, and M_hat = M (to float32 rounding) once span(P)
holds M's column space. A column that keeps at most ``reference.ORTHO_RTOL`` of its norm after
Gram-Schmidt is zeroed, and ``compute_p`` draws such columns afresh, the same on every rank (why:
docs/design.md, "Compressed collectives").

Wire bytes: 4 r (n + m), against 4 n m for float32 (r = 4, 1024 x 1024: 0.8%). Backends: the
Gram-Schmidt on NumPy or Numba (the same bits: float64 dot products added left to right in both);
the three matrix products always on NumPy's BLAS. No CUDA path yet.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from . import cpu, reference
from .base import Codec, as_f32, as_shape

__all__ = ["PowerSGDCodec", "matrix_shape"]


def matrix_shape(shape) -> tuple[int, int]:
    """The (n, m) matrix view of an array shape: (shape[0], rest); 1-D is (1, n)."""
    shape = as_shape(shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], int(np.prod(shape[1:], dtype=np.int64))


class PowerSGDCodec(Codec):
    """Payload: (P float32 (n, r), Q float32 (m, r)). State: Q per ``key``."""

    name: ClassVar[str] = "powersgd"
    lossy: ClassVar[bool] = True
    reduction: ClassVar[str] = "powersgd-phases"

    def __init__(self, rank: int = 4, *, seed: int = 0, vanilla_steps: int = 0, backend=None):
        super().__init__(backend=backend)
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if int(vanilla_steps) != vanilla_steps or vanilla_steps < 0:
            raise ValueError(f"vanilla_steps must be an integer >= 0, got {vanilla_steps!r}")
        self.vanilla_steps = int(vanilla_steps)  # first calls of a stream sent uncompressed (torch's start_powerSGD_iter)
        self.calls: dict = {}  # key -> calls counted by vanilla()
        self.rank = rank  # r, e.g. 4
        self.seed = int(seed)
        self.q_state: dict = {}  # key -> Q (m, r) float32, the warm start
        self._redraws: dict = {}  # key -> how many times zero columns of Q were drawn afresh

    # ---- phases a collective drives -------------------------------------------------

    def vanilla(self, key=None) -> bool:
        """Counts a call of stream ``key``; True while it is one of the first ``vanilla_steps``,
        which the caller sends uncompressed (a plain all_reduce, as torch's PowerSGD hook does
        before ``start_powerSGD_iter``): the warm start then begins from trained gradients."""
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        return n < self.vanilla_steps

    def compute_p(self, m: np.ndarray, *, key=None) -> np.ndarray:
        """P = M Q for M (n, m) float32; creates Q (seeded) on first use of ``key``."""
        q = self.q_state.get(key)
        if q is not None and q.shape[0] != m.shape[1]:
            raise ValueError(f"key {key!r} holds Q for {q.shape[0]} columns, got M {m.shape}; pass key=")
        if q is None:
            rng = np.random.default_rng(self.seed)
            q = rng.standard_normal((m.shape[1], self.rank)).astype(np.float32)
            self.q_state[key] = q
        dead = ~q.any(axis=0)  # zeroed by a rank-deficient step (see the module docstring)
        if dead.any():
            self._redraws[key] = count = self._redraws.get(key, 0) + 1
            rng = np.random.default_rng([self.seed, count])
            q[:, dead] = rng.standard_normal((q.shape[0], int(dead.sum()))).astype(np.float32)
        return m @ q

    def after_p_allreduce(self, p: np.ndarray) -> np.ndarray:
        """Orthonormalize the columns of P in place (Gram-Schmidt; dependent columns become
        zero); returns P."""
        if self._backend_for(p) == "numpy":
            return reference.orthogonalize(p)
        cpu.orthogonalize(p)
        return p

    def compute_q(self, m: np.ndarray, p: np.ndarray, *, key=None) -> np.ndarray:
        """Q = M^T P, written into the state; returns the state array itself.

        The collective all-reduces the returned array in place, which updates
        the warm start for the next step.
        """
        q = self.q_state[key]
        np.matmul(m.T, p, out=q)
        return q

    def decompress(self, p: np.ndarray, q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """M_hat = P Q^T, (n, m) float32."""
        return np.matmul(p, q.T, out=out)

    # ---- single-process Codec interface ------------------------------------------------

    def encode(self, x, *, key=None):
        """All phases with identity all-reduces. Returns (P, a copy of Q)."""
        m = as_f32(x).reshape(matrix_shape(np.shape(x)))
        p = self.after_p_allreduce(self.compute_p(m, key=key))
        q = self.compute_q(m, p, key=key)
        return p, q.copy()

    def decode(self, payload, shape):
        """See base class."""
        p, q = payload
        shape = as_shape(shape)
        return self.decompress(p, q).reshape(shape)

    def wire_nbytes(self, shape) -> int:
        """See base class: 4 r (n + m)."""
        return sum(self.payload_nbytes(shape))

    def payload_nbytes(self, shape) -> tuple[int, ...]:
        """See base class: P (n x r) and Q (m x r), float32."""
        n, m = matrix_shape(shape)
        return 4 * self.rank * n, 4 * self.rank * m

    def __repr__(self) -> str:
        vanilla = f", vanilla_steps={self.vanilla_steps}" if self.vanilla_steps else ""
        return f"PowerSGDCodec(rank={self.rank}, seed={self.seed}{vanilla})"
