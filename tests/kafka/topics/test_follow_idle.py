"""A follower whose fetches the broker holds for a batch (schedule's follower
of every token partition) asks as an idle consumer does while nothing comes:
a few fetches a second, not one each batch wait, and the first record after
the quiet still comes at once; while records come, its fetches are held for a
batch again."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from aiokafka.conn import AIOKafkaConnection

from conveyor.settings import load_settings
from topics.admin import ensure_topics
from topics.catalog import CONTROL, catalog
from topics.clients import make_producer
from topics.follow import Follower, follow

BATCH_WAIT_MS, BATCH_BYTES = 20, 256 * 1024


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[int]]:
    """Fetch requests sent, by the id of the connection that sent them."""
    sent: Counter[int] = Counter()
    send = AIOKafkaConnection.send

    def counting(self: AIOKafkaConnection, request: Any, *args: Any, **kw: Any) -> Any:
        if type(request).__name__ == "FetchRequest":
            sent[id(self)] += 1
        return send(self, request, *args, **kw)

    monkeypatch.setattr(AIOKafkaConnection, "send", counting)
    yield sent


async def test_an_idle_batching_follower_asks_rarely_and_hears_at_once(
        services: None, fetches: Counter[int]) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    control = CONTROL.at(settings.kafka)
    await ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name == control])
    follower: Follower[Any] = follow(settings, control, 0, "end", poll_ms=200,
                                     fetch_max_wait_ms=BATCH_WAIT_MS,
                                     fetch_min_bytes=BATCH_BYTES)
    arrived: list[float] = []

    async def read() -> None:
        async for batch in follower:
            arrived.extend(time.monotonic() for _ in batch)

    reading = asyncio.create_task(read())
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        await asyncio.wait_for(follower.caught_up.wait(), 30)
        await asyncio.sleep(1.0)  # quiet: its fetches become an idle consumer's
        fetches.clear()
        await asyncio.sleep(3.0)
        idle = sum(fetches.values())
        # held 20 ms a fetch it would ask about 150 times in 3 s; as an idle
        # consumer, twice a second (and a probe's)
        assert idle <= 12, f"{idle} fetches in 3 s of quiet"

        sent = time.monotonic()
        await producer.send_and_wait(control, b"after the quiet", key=b"a")
        for _ in range(100):
            if arrived:
                break
            await asyncio.sleep(0.01)
        # answered at the record, not at the end of a held fetch (500 ms)
        assert arrived and arrived[0] - sent < 0.25, arrived

        # records coming: its fetches are held for a batch again
        for n in range(20):
            await producer.send_and_wait(control, b"busy %d" % n, key=b"b")
            await asyncio.sleep(0.02)
        for _ in range(100):
            if len(arrived) == 21:
                break
            await asyncio.sleep(0.01)
        assert len(arrived) == 21
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await producer.stop()
