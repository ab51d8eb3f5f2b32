"""runtime.sharedmem without collectives: names and clean-up, sequence words, futex, segments."""

from __future__ import annotations

import os
import threading
import time

import pytest

from runtime.sharedmem import domains, segments, waits


def test_encode_and_reached_wrap_around():
    assert waits.encode(5, 1) == 41 and waits.encode(5, waits.EXIT) == 47
    assert waits.reached(waits.encode(6, 1), waits.encode(5, waits.EXIT))
    assert not waits.reached(waits.encode(5, 2), waits.encode(5, 3))
    big = (1 << 29) - 1  # the last call number before the 32-bit word wraps
    assert waits.encode(big + 1, 1) == 1
    assert waits.reached(waits.encode(big + 1, 1), waits.encode(big, waits.EXIT))  # past the wrap
    assert not waits.reached(waits.encode(big, waits.EXIT), waits.encode(big + 1, 1))


def test_job_prefix_is_a_file_name():
    assert segments.job_prefix("10.0.0.1:29500") == "ringweave-10.0.0.1_29500-"
    assert "/" not in segments.job_prefix("a/b/../c")


def test_remove_job_segments_of_a_job_and_its_ranks(tmp_path):
    names = ["ringweave-j1-ab12-g0d0-r0-ctl", "ringweave-j1-ab12-g0d0-r1-v20", "ringweave-j1-ab12-g0d0-r12-ctl",
             "ringweave-j2-cd34-g0d0-r0-ctl", "other-file"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert [os.path.basename(p) for p in segments.job_segments("j1", [1, 12], str(tmp_path))] == \
        ["ringweave-j1-ab12-g0d0-r1-v20", "ringweave-j1-ab12-g0d0-r12-ctl"]
    removed = segments.remove_job_segments("j1", [0], str(tmp_path))
    assert [os.path.basename(p) for p in removed] == ["ringweave-j1-ab12-g0d0-r0-ctl"]
    segments.remove_job_segments("j1", directory=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["other-file", "ringweave-j2-cd34-g0d0-r0-ctl"]


def test_shm_usable_follows_the_switch(monkeypatch, tmp_path):
    monkeypatch.delenv("RINGWEAVE_SHM", raising=False)
    assert segments.shm_usable(str(tmp_path))
    monkeypatch.setenv("RINGWEAVE_SHM", "0")
    assert not segments.shm_usable(str(tmp_path))
    monkeypatch.setenv("RINGWEAVE_SHM", "1")
    assert not segments.shm_usable(str(tmp_path / "missing"))


@pytest.fixture
def segment():
    path = os.path.join(segments.SHM_DIR, f"ringweave-unit{os.getpid()}-seg")
    seg = segments.Segment.create(path, 4096)
    yield seg
    seg.unlink()
    seg.close()


def test_segment_create_attach_unlink(segment):
    other = segments.Segment.attach(segment.path, 4096)
    segment.mm[100:104] = b"ring"
    assert bytes(other.mm[100:104]) == b"ring"  # one memory, two mappings
    with pytest.raises(FileExistsError):
        segments.Segment.create(segment.path, 4096)
    segment.unlink()
    assert not os.path.exists(segment.path)
    other.mm[0:1] = b"z"  # still mapped after the name is gone
    assert bytes(segment.mm[0:1]) == b"z"
    other.close()
    with pytest.raises(FileNotFoundError):
        segments.Segment.attach(segment.path, 4096)


def test_futex_times_out_and_wakes(segment):
    import ctypes
    word = ctypes.c_uint32.from_buffer(segment.mm, 0)
    t = time.monotonic()
    assert waits.futex_wait(segment.address, 0, 0.05) is False  # nobody posts: the slice ends
    assert 0.04 < time.monotonic() - t < 1.0
    assert waits.futex_wait(segment.address, 7, 5.0) is True  # the word is not 7: returns at once
    woke = []

    def sleeper():
        t0 = time.monotonic()
        while word.value == 0:  # noqa: F821 - the closure's word, deleted after the join
            waits.futex_wait(segment.address, 0, 5.0)
        woke.append(time.monotonic() - t0)

    th = threading.Thread(target=sleeper)
    th.start()
    time.sleep(0.1)
    word.value = 1
    waits.futex_wake(segment.address)
    th.join(5)
    del word
    assert woke and woke[0] < 2.0


class _Group:  # what Domain reads of a group before set-up
    rank = 0
    gid = 0


async def test_domain_lock_is_fifo_and_survives_a_cancelled_waiter():
    """Calls hold a domain one at a time, in the order they asked; a waiter cancelled while
    queued (or just as the domain was handed to it) does not strand the ones behind it."""
    import asyncio
    dom = domains.Domain(_Group(), [0, 1], "0d0")
    order = []

    async def call(name, hold_s=0.01):
        await dom._lock()
        order.append(name)
        await asyncio.sleep(hold_s)
        dom._unlock()

    await dom._lock()  # held by "first"
    b = asyncio.ensure_future(call("b"))
    c = asyncio.ensure_future(call("c"))
    d = asyncio.ensure_future(call("d"))
    await asyncio.sleep(0.01)
    c.cancel()  # queued: withdraws
    dom._unlock()  # hands over to b
    await asyncio.wait_for(asyncio.gather(b, d), 2)
    assert order == ["b", "d"] and c.cancelled()
    assert not dom._busy and not dom._lock_waiters

    await dom._lock()
    e = asyncio.ensure_future(call("e"))
    f = asyncio.ensure_future(call("f"))
    await asyncio.sleep(0.01)
    dom._unlock()  # hands over to e, which is cancelled before it runs: it passes the domain on
    e.cancel()
    await asyncio.wait_for(f, 2)
    assert order[-1] == "f" and e.cancelled()
    assert not dom._busy
    assert not dom.try_begin(None)  # not set up: the caller must await begin()
