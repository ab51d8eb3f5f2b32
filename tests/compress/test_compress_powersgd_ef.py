"""PowerSGD phases and maths, and ErrorFeedback over many steps, for every lossy codec."""

import numpy as np
import pytest

from collectives.compress import ErrorFeedback, get_codec, reference
from collectives.compress import cpu as ccpu
from collectives.compress.powersgd import matrix_shape


def low_rank(n, m, r, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, r)) @ rng.standard_normal((r, m))).astype(np.float32)


@pytest.mark.parametrize("shape", [(50, 4), (300, 7), (1, 9), (64, 64), (0, 3)])
def test_orthogonalize_numba_equals_numpy(shape):
    p = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    if shape[1] > 2:
        p[:, 2] = p[:, 0] * 2  # a dependent column: zeroed
    want, got = reference.orthogonalize(p.copy()), p.copy()
    ccpu.orthogonalize(got)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # same bits
    if shape[1] > 2 and shape[0] > 1:
        assert (want[:, 2] == 0).all()


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("rank_of_m", [0, 1, 2])
def test_rank_deficient_matrix_comes_back_exact_at_r4(backend, rank_of_m):
    m = low_rank(96, 70, rank_of_m, seed=7) if rank_of_m else np.zeros((96, 70), np.float32)
    codec = get_codec("powersgd", rank=4, backend=backend)
    for step in range(3):
        p, q = codec.encode(m)
        approx = codec.decode((p, q), m.shape)
        assert np.isfinite(approx).all()
        # P: rank_of_m orthonormal columns, the dependent ones zero (not unit columns of rounding noise)
        assert np.count_nonzero(np.abs(p).sum(axis=0)) == rank_of_m, (step, np.abs(p).sum(axis=0))
        np.testing.assert_allclose(approx, m, rtol=0, atol=1e-5 * max(1.0, np.abs(m).max()))
    full = low_rank(96, 70, 4, seed=8)  # Q's zeroed columns are drawn afresh: a rank-4 matrix is exact again
    np.testing.assert_allclose(codec.decode(codec.encode(full), full.shape), full, rtol=0,
                               atol=1e-4 * np.abs(full).max())


def test_orthogonalize_gives_orthonormal_columns_and_keeps_zero_columns():
    p = np.random.default_rng(2).standard_normal((200, 4)).astype(np.float32)
    p[:, 3] = 0
    for impl in (reference.orthogonalize, ccpu.orthogonalize):
        out = p.copy()
        impl(out)
        gram = out[:, :3].T @ out[:, :3]
        np.testing.assert_allclose(gram, np.eye(3), atol=1e-5)
        assert (out[:, 3] == 0).all()


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_phases_equal_encode_and_projection_bound(backend):
    m = np.random.default_rng(3).standard_normal((40, 30)).astype(np.float32)
    by_phase, whole = get_codec("powersgd", rank=3, backend=backend), get_codec("powersgd", rank=3, backend=backend)
    p = by_phase.compute_p(m)
    assert p.shape == (40, 3)
    by_phase.after_p_allreduce(p)
    q = by_phase.compute_q(m, p)
    assert q is by_phase.q_state[None]  # the collective all-reduces the state in place
    approx = by_phase.decompress(p, q)
    p2, q2 = whole.encode(m)
    np.testing.assert_array_equal(approx, whole.decode((p2, q2), m.shape))
    assert np.linalg.norm(m - approx) <= np.linalg.norm(m) * (1 + 1e-6)
    assert whole.wire_nbytes(m.shape) == p2.nbytes + q2.nbytes == 4 * 3 * (40 + 30)


def test_warm_start_recovers_a_low_rank_matrix():
    m = low_rank(80, 60, 2, seed=4)
    codec = get_codec("powersgd", rank=2)
    errors = []
    for _ in range(4):
        errors.append(np.linalg.norm(m - codec.decode(codec.encode(m), m.shape)) / np.linalg.norm(m))
    assert errors[-1] < 1e-5 and errors[-1] <= errors[0]


def test_two_ranks_by_phases_match_one_process_on_the_average():
    # The distributed recipe: all_reduce(avg) of P, then of Q, with the same seed on every rank.
    g0, g1 = low_rank(30, 20, 5, 5), low_rank(30, 20, 5, 6)
    ranks = [get_codec("powersgd", rank=2, seed=9) for _ in range(2)]
    ps = [c.compute_p(g) for c, g in zip(ranks, (g0, g1))]
    p_avg = (ps[0] + ps[1]) / 2
    for c in ranks:
        c.after_p_allreduce(p_avg.copy())
    p_avg = ranks[0].after_p_allreduce(p_avg)
    qs = [c.compute_q(g, p_avg) for c, g in zip(ranks, (g0, g1))]
    q_avg = (qs[0] + qs[1]) / 2
    single = get_codec("powersgd", rank=2, seed=9)
    p1, q1 = single.encode((g0 + g1) / 2)
    np.testing.assert_allclose(ranks[0].decompress(p_avg, q_avg), single.decode((p1, q1), g0.shape), atol=1e-4)


def test_powersgd_refuses_a_new_shape_on_the_same_key():
    codec = get_codec("powersgd")
    codec.encode(np.ones((8, 8), np.float32))
    with pytest.raises(ValueError, match="pass key="):
        codec.encode(np.ones((8, 9), np.float32))
    codec.encode(np.ones((8, 9), np.float32), key="other")
    assert matrix_shape((3, 4, 5)) == (3, 20) and matrix_shape(7) == (1, 7)


LOSSY = [("fp16", {}), ("bf16", {}), ("int8", {}), ("int8", {"stochastic": True}), ("topk", {}),
         ("topk", {"ratio": 0.1}), ("powersgd", {"rank": 2})]  # fmt: skip


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize(("name", "kw"), LOSSY, ids=str)
def test_error_feedback_tracks_the_sum_over_100_steps(name, kw, backend):
    shape = (48, 40)
    ef = get_codec(name, error_feedback=True, backend=backend, **kw)
    plain = get_codec(name, backend=backend, **kw)
    rng = np.random.default_rng(0)
    total, sent, sent_plain = (np.zeros(shape, np.float64) for _ in range(3))
    residual_max = []
    for step in range(100):
        g = (rng.standard_normal(shape) + 0.05).astype(np.float32)  # a small bias plain top-k loses
        total += g
        sent += ef.decode(ef.encode(g), shape)
        sent_plain += plain.decode(plain.encode(g), shape)
        residual_max.append(np.abs(ef.errors[None]).max())
    # identity: what was sent plus what is still carried is what came in (up to float32 rounding)
    np.testing.assert_allclose(sent + ef.errors[None], total, atol=1e-3)
    # bounded: the carried error does not grow with the number of steps
    assert max(residual_max[50:]) <= 2.0 * max(residual_max[:50]) + 1e-6
    drift, drift_plain = np.abs(total - sent).max(), np.abs(total - sent_plain).max()
    if name in ("topk", "powersgd"):
        assert drift < 0.5 * drift_plain


def test_error_feedback_split_phases_and_validation():
    ef = ErrorFeedback(get_codec("int8"))
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    y = ef.compensate(x)
    payload = ef.codec.encode(y)
    ef.update(y, payload)
    np.testing.assert_array_equal(ef.errors[None], y - ef.decode(payload, x.shape))
    with pytest.raises(ValueError, match="pass key="):
        ef.encode(np.ones(10, np.float32))
    with pytest.raises(ValueError, match="lossy"):
        ErrorFeedback(get_codec("none"))
    ef.reset()
    assert not ef.errors


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_fused_residual_equals_generic(name):
    x = np.random.default_rng(8).standard_normal(999).astype(np.float32)
    fast, slow = get_codec(name, backend="numba"), get_codec(name, backend="numpy")
    payload = fast.encode(x)
    e_fast, e_slow = np.empty_like(x), np.empty_like(x)
    fast.residual_into(x, payload, e_fast)
    slow.residual_into(x, payload, e_slow)
    np.testing.assert_array_equal(e_fast, e_slow)


def test_decode_add_accumulates_gathered_payloads():
    xs = [np.random.default_rng(s).standard_normal(700).astype(np.float32) for s in range(3)]
    for name in ("int8", "topk", "fp16"):
        codec = get_codec(name)
        acc = np.zeros(700, np.float32)
        for x in xs:
            codec.decode_add(codec.encode(x), acc)
        want = sum(codec.decode(codec.encode(x), 700) for x in xs)
        np.testing.assert_allclose(acc, want, rtol=0, atol=1e-6)
