"""collectives/slots/atomics.py: the compiled atomics, fences and system calls, under contention.

Threads run compiled, GIL-free loops on the same words at once (two cores: really at once), and the
outcome is checked against a plain reference: the closed-form count of every increment for the
read-modify-write, every message's payload for release/acquire (a producer fills a block then
publishes its number; a consumer that sees the number must see the whole block), and the futex's
documented answers (-EAGAIN, -ETIMEDOUT, a wake).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from numba import njit

from collectives.slots import atomics as at

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not at.SUPPORTED, reason="compiled atomics: Linux on x86-64 or AArch64 only")]


@njit(nogil=True, cache=True)
def _add_many(address, times):
    for _ in range(times):
        at.fetch_add_u32(address, np.uint32(1))


@njit(nogil=True, cache=True)
def _produce(seq_address, ack_address, block, messages):
    """Message k: every element of ``block`` is k, then the sequence word k (release); waits for the
    consumer's ack of k (acquire) before overwriting the block."""
    for k in range(1, messages + 1):
        for i in range(block.size):
            block[i] = k
        at.store_release_u32(seq_address, np.uint32(k))
        while at.load_acquire_u32(ack_address) != k:
            at.cpu_relax()


@njit(nogil=True, cache=True)
def _consume(seq_address, ack_address, block, messages):
    """Returns how many elements did not hold the message number the sequence word promised."""
    torn = 0
    for k in range(1, messages + 1):
        while at.load_acquire_u32(seq_address) != k:
            at.cpu_relax()
        for i in range(block.size):
            if block[i] != k:
                torn += 1
        at.store_release_u32(ack_address, np.uint32(k))
    return torn


@njit(nogil=True, cache=True)
def _store_load(address, value):
    at.store_release_u64(address, value)
    at.fence()
    return at.load_acquire_u64(address)


@njit(nogil=True, cache=True)
def _futex_wait(address, expected, timeout_ns, scratch):
    return at.futex_wait(address, expected, timeout_ns, scratch)  # (the helpers hold the GIL: inlined only)


def _threads(fns) -> list:
    out = [None] * len(fns)

    def run(i):
        out[i] = fns[i]()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts), "a compiled loop hung"
    return out


def test_fetch_add_loses_no_increment_under_contention():
    words = np.zeros(16, np.uint32)  # word 0 shared by all, word 8 by nobody else (another cache line)
    threads, times = 4, 200_000
    _add_many(words.ctypes.data, 1)  # compiled before the race
    words[:] = 0
    _threads([lambda: _add_many(words.ctypes.data, times)] * threads)
    assert int(words[0]) == threads * times
    assert int(words[8]) == 0
    words[0] = 0xFFFFFFFF  # wraps as a u32
    _add_many(words.ctypes.data, 2)
    assert int(words[0]) == 1


def test_release_acquire_publishes_a_whole_block():
    words = np.zeros(32, np.uint32)  # sequence word and ack word on different cache lines
    block = np.zeros(4096, np.int64)
    seq, ack = words.ctypes.data, words.ctypes.data + 64
    messages = 3000
    torn = _threads([lambda: _produce(seq, ack, block, messages), lambda: _consume(seq, ack, block, messages)])[1]
    assert torn == 0
    assert int(words[0]) == int(words[16]) == messages and np.all(block == messages)


def test_wide_store_and_load_round_trip():
    word = np.zeros(2, np.uint64)
    for value in (0, 1, 2**63 + 12345, 2**64 - 1):
        assert int(_store_load(word.ctypes.data, np.uint64(value))) == value == int(word[0])


def test_futex_answers_as_the_kernel_documents():
    word = np.array([7, 0], np.uint32)
    ts = np.zeros(2, np.int64)
    address, scratch = word.ctypes.data, ts.ctypes.data
    assert at.futex_wait(address, 8, 5_000_000_000, scratch) == -at.EAGAIN  # the word is not 8: at once
    t = time.monotonic()
    assert at.futex_wait(address, 7, 20_000_000, scratch) == -at.ETIMEDOUT
    assert 0.015 < time.monotonic() - t < 5.0
    assert at.futex_wake(address, 1) == 0  # nobody sleeps
    woke = []

    def sleeper():
        woke.append(_futex_wait(address, 7, 30_000_000_000, scratch))  # a long sleep, cut by the wake

    th = threading.Thread(target=sleeper)
    th.start()
    t = time.monotonic()
    while th.is_alive() and time.monotonic() - t < 20:
        word[0] = 7
        if at.futex_wake(address, 1) == 1:
            break
        time.sleep(0.001)
    th.join(20)
    assert not th.is_alive() and woke == [0]
    now = at.monotonic_ns(scratch)
    assert abs(now - time.monotonic_ns()) < 1_000_000_000
