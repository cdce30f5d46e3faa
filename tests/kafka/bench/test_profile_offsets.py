"""bench.profile's count of the records a run wrote, on the real broker."""

from __future__ import annotations

import uuid

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.profile import topic_offsets
from conveyor.settings import load_settings


async def test_the_records_of_every_partition_of_the_runs_topics_are_counted() -> None:
    bootstrap = load_settings().kafka.bootstrap
    prefix = f"t{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    topics = [f"{prefix}.tokens", f"{prefix}.replies"]
    await admin.create_topics([NewTopic(t, 2, 1) for t in topics])
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        before = await topic_offsets(bootstrap, prefix)
        for partition in (0, 1, 1):
            await producer.send_and_wait(topics[0], b"x", partition=partition)
        after = await topic_offsets(bootstrap, prefix)
        after.subtract(before)
        assert after == {topics[0]: 3, topics[1]: 0}
    finally:
        await producer.stop()
        await admin.delete_topics(topics)
        await admin.close()
