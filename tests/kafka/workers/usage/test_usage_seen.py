"""Reading back the request ids before an offset of the usage topic, on the real
Kafka (workers/usage/counting.py): what the accounting app's window of recent
request ids is rebuilt from after a restart or a rebalance."""

from __future__ import annotations

import uuid

from conveyor.settings import load_settings
from schemas.codec import default_codec
from schemas.records import UsageRecord
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import make_producer
from workers.usage.counting import ids_before


def usage(rid: str) -> UsageRecord:
    return UsageRecord(request_id=rid, tenant="acme", key_id="k1", model="m1", kind="chat",
                       status="completed", prompt_tokens=1, completion_tokens=1,
                       entered_ms=1, finished_ms=2)


async def test_the_ids_before_an_offset_come_back_in_order_with_gaps_for_poison(
        services: None) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    topic = settings.kafka.topic("usage")
    await ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name == topic])
    codec = default_codec()
    values = [codec.encode("UsageRecord", usage(f"r{i}")) for i in range(6)]
    values[2] = b"not a usage record"
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=b"acme", partition=1)
    finally:
        await producer.stop()

    assert await ids_before(settings, topic, 1, 5, 3) == [(2, None), (3, "r3"), (4, "r4")]
    assert await ids_before(settings, topic, 1, 3, 100) == [(0, "r0"), (1, "r1"), (2, None)]
    assert await ids_before(settings, topic, 1, 0, 100) == []
    assert await ids_before(settings, topic, 0, 0, 100) == []
