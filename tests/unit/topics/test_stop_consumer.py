"""A follower's cancel is never held by a Kafka client that will not stop: a
consumer whose ``stop`` swallows its cancel and waits for a broker that is gone
(a CI run hung here for twenty minutes) is left to end on its own."""

from __future__ import annotations

import asyncio
import time

from topics.clients import stop_consumer


class Stubborn:
    """A consumer whose stop ignores every cancel and never ends by itself."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def stop(self) -> None:
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue  # swallowed, as a client that retries its close does


async def test_a_cancel_of_the_follower_ends_it_at_once() -> None:
    consumer = Stubborn()
    closing = asyncio.create_task(stop_consumer(consumer, within=60))
    await asyncio.sleep(0.05)
    closing.cancel()
    started = time.monotonic()
    done, _ = await asyncio.wait({closing}, timeout=2)
    assert done and closing.cancelled() and time.monotonic() - started < 1
    consumer.release.set()


async def test_a_stop_past_its_bound_is_left_behind() -> None:
    consumer = Stubborn()
    started = time.monotonic()
    await stop_consumer(consumer, within=0.2)
    assert time.monotonic() - started < 1
    consumer.release.set()
