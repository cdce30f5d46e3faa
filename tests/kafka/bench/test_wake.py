"""bench.wake's Kafka probe on the real broker: Conveyor's producer and a group consumer."""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient

from bench.wake import KafkaProbe, kafka_probes
from conveyor.settings import load_settings


async def test_each_probe_is_acknowledged_and_fetched_and_the_topic_goes() -> None:
    settings = load_settings()
    async with KafkaProbe(settings) as probe:
        acks, hops = await kafka_probes(probe, 3, 0.005)
    assert len(acks) == len(hops) == 3
    assert all(0 < ms < 5000 for ms in acks + hops)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        assert probe.topic not in await admin.list_topics()
    finally:
        await admin.close()
