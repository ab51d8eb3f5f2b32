"""Counting the event loop's turns in a test: a task that runs once per turn of the loop.

    async with counted() as turned:
        await something()
    assert turned.count >= 3

``on_turn`` (optional) is called at every turn too (e.g. to close an account of the work done
between two turns).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable


class Turned:
    count = 0  # turns of the loop since the block began


@contextlib.asynccontextmanager
async def counted(on_turn: Callable[[], None] | None = None):
    turned = Turned()

    async def tick():
        while True:
            if on_turn is not None:
                on_turn()
            turned.count += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(tick())
    await asyncio.sleep(0)  # it has started: count from here
    turned.count = 0
    try:
        yield turned
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
