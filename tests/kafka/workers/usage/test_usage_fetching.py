"""Where the accounting app's consumer resumes after a rebalance, on the real
Kafka (workers/usage/flow.py): a partition with nothing committed goes back
to its beginning, so records fetched and then cleared from Faust's queues are
read again."""

from __future__ import annotations

import asyncio
import uuid

from aiokafka import TopicPartition

from conveyor.settings import load_settings
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import make_consumer, make_producer, stop_consumer
from workers.usage.flow import seek_committed_or_earliest


async def test_a_partition_never_committed_is_read_again_from_its_beginning(
        services: None) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    feedback, usage = settings.kafka.topic("feedback"), settings.kafka.topic("usage")
    await ensure_topics(settings, [s for s in catalog(settings.kafka)
                                   if s.name in (feedback, usage)])
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for i in range(5):
            await producer.send_and_wait(feedback, f"f{i}".encode(), partition=0)
            await producer.send_and_wait(usage, f"u{i}".encode(), partition=0)
    finally:
        await producer.stop()
    consumer = make_consumer(settings.kafka, feedback, usage,
                             group=settings.kafka.group("accounting"))
    await consumer.start()
    try:
        fb, us = TopicPartition(feedback, 0), TopicPartition(usage, 0)
        read: list[bytes] = []
        async with asyncio.timeout(30):
            while len(read) < 10:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    read += [r.value for r in records if r.value is not None]
        # usage[0] committed at 3; feedback[0] never: both read to their end
        await consumer.commit({us: 3})
        assert (await consumer.position(fb), await consumer.position(us)) == (5, 5)

        committed = await seek_committed_or_earliest(consumer)

        assert committed[fb] is None and committed[us] == 3
        # aiokafka's own seek_to_committed left feedback[0] at 5: what was
        # fetched and dropped before would never be read again
        assert (await consumer.position(fb), await consumer.position(us)) == (0, 3)
        # a partition ``restart`` turns down (a changelog) keeps its position
        await consumer.getmany(fb, timeout_ms=2000)
        kept = await consumer.position(fb)
        await seek_committed_or_earliest(consumer, lambda tp: tp.topic != feedback)
        assert await consumer.position(fb) == kept > 0
    finally:
        await stop_consumer(consumer)
