"""What an event loop did while a coroutine ran: whether it stayed free for others."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["ticks_while"]

T = TypeVar("T")


async def ticks_while(work: Awaitable[T]) -> tuple[T, int]:
    """What ``work`` gives, and how many times the loop ran another task meanwhile:
    0 when ``work`` never let go of the loop."""
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            await asyncio.sleep(0)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        result = await work
    finally:
        done = True
        await task
    return result, ticks
