"""A cancel asked for while Kafka is down reaches ``control`` once it is back.

The gateway's cancel is a background send (its client has often gone); it
was once one attempt whose failure was swallowed, so a client that left
during an outage longer than the producer's request timeout left its
generation running until the deadline. The publisher's must-arrive send
retries it with backoff until the broker takes it.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from conveyor.settings import Settings, load_settings
from gateway.cancels import Cancels
from schemas.codec import default_codec
from tests.support.gateway_fakes import cancels
from tests.support.services import OwnKafka
from topics.admin import ensure_topics
from topics.catalog import CONTROL, catalog
from topics.clients import make_producer
from topics.follow import follow

TIMEOUT_MS = 3000  # the producer's request timeout (30 s in production): the outage outlasts it


async def cancels_on(settings: Settings, wanted: set[str], within: float) -> list[str]:
    """The request ids of the cancels on ``control``, read until every one of
    ``wanted`` is among them (retried sends arrive in any order) or ``within``
    seconds have passed."""
    codec = default_codec()
    follower = follow(settings, CONTROL, 0, "beginning")
    found: list[str] = []

    async def read() -> None:
        async for records in follower:
            found.extend(codec.decode(m.value, "Control")["request_id"] for m in records)
            if wanted <= set(found):
                return

    try:
        await asyncio.wait_for(read(), within)
    except TimeoutError:
        pass
    return found


async def cancel_steadily(gateway: Cancels, stop: asyncio.Event, asked: list[str]) -> None:
    """A gateway under load: a cancel every 50 ms, so that the broker's controlled
    shutdown is seen (NotLeaderForPartition: the control partition has no leader)."""
    while not stop.is_set():
        asked.append(f"r-steady-{len(asked)}")
        gateway.cancel(asked[-1], "client disconnected")
        await asyncio.sleep(0.05)


async def test_a_cancel_asked_for_while_kafka_is_down_arrives_after_it_is_back(
        own_kafka: OwnKafka) -> None:
    settings = load_settings(kafka_bootstrap=own_kafka.bootstrap, retry_backoff_max_s=1.0,
                        topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    await ensure_topics(settings, [s for s in catalog(settings.kafka)
                                   if s.name == CONTROL.at(settings.kafka)])
    producer = make_producer(settings.kafka, request_timeout_ms=TIMEOUT_MS)
    await producer.start()
    gateway = cancels(settings, producer)
    asked: list[str] = []
    stop = asyncio.Event()
    steady = asyncio.create_task(cancel_steadily(gateway, stop, asked))
    try:
        await asyncio.sleep(1)
        await asyncio.to_thread(own_kafka.stop)
        stop.set()
        await steady
        gateway.cancel("r-outage", "client disconnected")
        await asyncio.sleep(TIMEOUT_MS / 1000 + 2)  # its first attempt has expired by now
        await asyncio.to_thread(own_kafka.start)
        back = time.monotonic()
        found = await cancels_on(settings, {"r-outage", *asked}, within=30)
        assert "r-outage" in found and time.monotonic() - back < 30
        assert set(asked) <= set(found)  # none asked for in the shutdown was lost either
    finally:
        stop.set()
        await steady
        await producer.stop()
