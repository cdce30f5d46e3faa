"""A broker restart that outlasts the producer's request timeout.

The broker's controlled shutdown answers NotLeaderForPartition, the
producer's metadata then says the partition has no leader, and aiokafka
expires that partition's waiting batches after ``request_timeout_ms`` with
their sequence numbers already taken. Once the broker is back it refuses
every later batch of the partition with OutOfOrderSequenceNumber; Conveyor's
producer starts afresh instead, so after the restart every record goes
through (the postprocess layer once gave up replies for this, cutting a
resumed answer in half).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

from conveyor.settings import load_settings
from tests.support.services import OwnKafka
from tests.support.topics import create_topic
from topics.clients import make_producer
from topics.producer import Producer

TIMEOUT_MS = 3000  # the batches' time to live with no leader (30 s in production)
OUTAGES = 3


async def steady(producer: Producer, topic: str, stop: asyncio.Event,
                 outcomes: list[tuple[float, str]]) -> None:
    """Send a record every 20 ms, noting when each was sent and how it ended."""
    async def one(i: int) -> None:
        sent = time.monotonic()
        try:
            await producer.send_and_wait(topic, f"m{i}".encode(), key=b"r1")
            outcomes.append((sent, "ok"))
        except Exception as exc:
            outcomes.append((sent, type(exc).__name__))

    tasks = []
    while not stop.is_set():
        tasks.append(asyncio.create_task(one(len(tasks))))
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)


async def test_records_go_through_after_a_restart_that_expired_batches(
        own_kafka: OwnKafka) -> None:
    topic = f"t{uuid.uuid4().hex[:10]}.sequence"
    await create_topic(own_kafka.bootstrap, topic)
    producer = make_producer(load_settings(kafka_bootstrap=own_kafka.bootstrap).kafka,
                             request_timeout_ms=TIMEOUT_MS)
    await producer.start()
    outcomes: list[tuple[float, str]] = []
    stop = asyncio.Event()
    sending = asyncio.create_task(steady(producer, topic, stop, outcomes))
    try:
        await asyncio.sleep(1)
        # Whether an outage breaks the sequence depends on where the waiting
        # batches are when they expire (only those drained to the dead broker
        # took their numbers): outages follow one another, each checked, until
        # one broke the first producer, as most do
        for _ in range(OUTAGES):
            await asyncio.to_thread(own_kafka.stop)
            await asyncio.sleep(TIMEOUT_MS / 1000 + 2)  # the waiting batches expire
            await asyncio.to_thread(own_kafka.start)
            back = time.monotonic()
            await asyncio.sleep(5)
            after = Counter(how for sent, how in outcomes if back + 1 < sent)
            assert after and set(after) == {"ok"}, after
            if producer.renewals:
                break
        stop.set()
        await sending
        assert "OutOfOrderSequenceNumber" not in {how for _, how in outcomes}
        assert producer.renewals >= 1, f"{OUTAGES} outages and none broke the producer"
    finally:
        stop.set()
        await sending
        await producer.stop()
