"""runtime/turns.py: when a turn of the loop is overdue, on a clock the test moves by hand."""

from __future__ import annotations

import asyncio

import pytest

from runtime import turns


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(turns, "_clock", lambda: now[0])
    return now


async def test_a_turn_is_overdue_turn_s_after_the_last_one_recorded(clock):
    t = turns.LoopTurns(asyncio.get_running_loop())
    assert t.overdue(), "no turn recorded yet: the first check yields"
    await asyncio.sleep(0)  # the loop turns; the callback armed by the check records it
    assert not t.overdue() and t.left() == pytest.approx(turns.TURN_S)
    clock[0] += 0.9 * turns.TURN_S  # past the quiet half: this check arms the record of the next turn
    assert not t.overdue() and t.left() == pytest.approx(0.1 * turns.TURN_S)
    clock[0] += 0.2 * turns.TURN_S
    assert t.overdue() and t.left() < 0
    await asyncio.sleep(0)
    assert not t.overdue()
    assert t.yields == 2


async def test_a_turn_taken_by_a_wait_counts(clock):
    """Any turn of the loop counts, not only the yields the checks ask for."""
    t = turns.LoopTurns(asyncio.get_running_loop())
    t.overdue()
    await asyncio.sleep(0)
    clock[0] += 0.6 * turns.TURN_S
    assert not t.overdue()  # arms
    await asyncio.get_running_loop().run_in_executor(None, lambda: None)  # a wait: the loop turns
    clock[0] += 0.6 * turns.TURN_S
    assert not t.overdue(), "1.2 x TURN_S since the first turn, but the wait's turn came 0.6 x TURN_S ago"


def test_pieces_are_piece_nbytes_of_traffic(monkeypatch):
    monkeypatch.setattr(turns, "PIECE_NBYTES", 4 << 20)
    assert turns.piece_items(4, 2) == 512 << 10  # a float32 copy: 2 MiB in, 2 MiB out
    assert turns.piece_items(4, 3) == (4 << 20) // 12 // 1024 * 1024  # dst <op>= src, in whole pages
    assert turns.piece_items(1, 2) == 2 << 20  # a socket's read or write
    assert turns.piece_items(8, 1 << 30) == 1  # never nothing
