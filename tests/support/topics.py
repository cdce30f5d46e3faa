"""Reading a test Conveyor's topics whole, as they are now (a test checks what
the pipeline wrote: audit events, token chunks, no secret anywhere)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from conveyor.settings import Settings
from tests.support.pipeline import Pipeline
from topics.clients import make_producer


async def create_topic(bootstrap: str, name: str, partitions: int = 1) -> None:
    """Create one topic (replication 1) on the broker at ``bootstrap``."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()


async def send_retrying(settings: Settings, topic: str, sends: list[dict[str, Any]],
                        within_s: float = 90) -> None:
    """Send each of ``sends`` (``send_and_wait``'s keywords: value, key,
    partition) in order, retrying with a fresh producer until the broker
    takes them all (a broker that is restarting), at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        producer = make_producer(settings.kafka, request_timeout_ms=5000)
        try:
            await producer.start()
            for send in sends:
                await producer.send_and_wait(topic, **send)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)
        finally:
            await producer.stop()


async def behind(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    return any([await consumer.position(tp) < end for tp, end in ends.items()])


async def partitions_of(consumer: AIOKafkaConsumer, topics: list[str]) -> list[TopicPartition]:
    """Every partition of ``topics`` (after the metadata of each is fetched)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=consumer._client._bootstrap_servers)  # noqa: SLF001
    await admin.start()
    try:
        described = await admin.describe_topics(topics)
    finally:
        await admin.close()
    return [TopicPartition(t["topic"], part["partition"]) for t in described
            for part in t["partitions"]]


async def from_the_end(bootstrap: str, topic: str, **options: Any) -> AIOKafkaConsumer:
    """A started consumer of every partition of ``topic``, standing at its end
    (positions resolved): it reads only what is written after this returns."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                fetch_max_wait_ms=20, **options)
    await consumer.start()
    try:
        consumer.assign(await partitions_of(consumer, [topic]))
        await consumer.seek_to_end()
        for tp in consumer.assignment():
            await consumer.position(tp)
    except BaseException:
        await consumer.stop()
        raise
    return consumer


async def records(p: Pipeline, topics: list[str]) -> list[Any]:
    """Every record of ``topics``, from the beginning to their ends now."""
    consumer = AIOKafkaConsumer(bootstrap_servers=p.settings.kafka.bootstrap,
                                enable_auto_commit=False)
    await consumer.start()
    out: list[Any] = []
    try:
        parts = await partitions_of(consumer, topics)
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and await behind(consumer, ends):
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                out.extend(batch)
    finally:
        await consumer.stop()
    return out


async def topic_names(p: Pipeline) -> list[str]:
    """Every topic of the test Conveyor's prefix."""
    admin = AIOKafkaAdminClient(bootstrap_servers=p.settings.kafka.bootstrap)
    await admin.start()
    try:
        return [t for t in await admin.list_topics() if t.startswith(p.prefix)]
    finally:
        await admin.close()


def traces_of(p: Pipeline, needles: list[bytes], logs: bool = True) -> list[str]:
    """Where any of ``needles`` is found: the processes' logs (with ``logs``),
    the prefix's Redis keys and values, and every record of its topics."""
    import asyncio

    import redis

    found: list[str] = []
    if logs:
        for path in (f for f in p.logs.iterdir() if f.is_file()):
            data = path.read_bytes()
            found += [f"log {path.name}" for n in needles if n in data]
    client = redis.Redis.from_url(p.settings.redis.url)
    try:
        for key in client.scan_iter(match=f"{p.prefix}:*", count=1000):
            dumped = client.dump(key) or b""
            found += [f"redis {key!r}" for n in needles if n in dumped or n in key]
    finally:
        client.close()
    for record in asyncio.run(records(p, asyncio.run(topic_names(p)))):
        raw = (record.key or b"") + (record.value or b"")
        found += [f"topic {record.topic}@{record.offset}" for n in needles if n in raw]
    return found
