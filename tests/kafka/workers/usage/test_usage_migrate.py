"""Ratings an earlier Conveyor counted in two tables carried into the one
ratings table on the real broker (workers/usage/migrate.py): every row and
latest rating as the old changelogs last held them, rows first, the old
changelogs deleted, and a second start that finds nothing to do."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from conveyor.settings import Settings
from tests.unit.workers.usage.test_usage_ratings import NOW, rating
from topics.admin import drop_topics
from topics.clients import make_consumer
from workers.usage.migrate import OLD_LATEST, OLD_TOTALS, carry_old_ratings
from workers.usage.ratings import LATEST, Ratings

NEW = "feedback-ratings"


def faust(value: Any) -> bytes:
    """A key or value as Faust's JSON serializer writes it."""
    return json.dumps(value).encode()


async def read(settings: Settings, topic: str) -> list[tuple[bytes, bytes]]:
    tp = TopicPartition(topic, 0)
    consumer = make_consumer(settings, group=None)
    await consumer.start()
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        out: list[tuple[bytes, bytes]] = []
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(tp, timeout_ms=500)).values():
                out += [(r.key, r.value) for r in records]
        return out
    finally:
        await consumer.stop()


async def test_the_two_old_tables_become_the_one(services: None) -> None:
    settings = Settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    app_id = settings.group("accounting")
    # what today's table holds after these ratings; the old tables held the same
    # rows, and each latest rating under the bare request id
    today = Ratings({}, lambda: NOW)
    for offset, (rid, score) in enumerate([("a", 1.0), ("b", -1.0), ("a", 0.5)]):
        assert today.count(rating(rid, score), 0, offset)
    rows = {k: v for k, v in today.table.items() if not k.startswith(LATEST)}
    latest = {k[len(LATEST):]: v for k, v in today.table.items() if k.startswith(LATEST)}
    names = {t: f"{app_id}-{t}-changelog" for t in (OLD_TOTALS, OLD_LATEST, NEW)}
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
    await producer.start()
    try:
        await admin.create_topics([NewTopic(n, 1, 1) for n in names.values()])
        first_row = next(iter(rows))
        old = [(OLD_TOTALS, first_row, {"stale": True}),  # overwritten below
               *[(OLD_TOTALS, k, v) for k, v in rows.items()],
               (OLD_TOTALS, "[\"gone\"]", {"n": 1}), (OLD_TOTALS, "[\"gone\"]", None),
               *[(OLD_LATEST, k, v) for k, v in latest.items()]]
        for table, key, value in old:
            await producer.send_and_wait(names[table], None if value is None else faust(value),
                                         key=faust(key))

        assert await carry_old_ratings(settings, app_id, NEW) == len(rows) + len(latest)
        carried = await read(settings, names[NEW])
        restored = {json.loads(k): json.loads(v) for k, v in carried}
        assert restored == today.table
        assert [json.loads(k) for k, _ in carried][:len(rows)] == list(rows)  # rows first
        deadline = time.monotonic() + 30
        while {names[OLD_TOTALS], names[OLD_LATEST]} & set(await admin.list_topics()):
            assert time.monotonic() < deadline, "the old changelogs were not deleted"
            await asyncio.sleep(0.2)
        assert await carry_old_ratings(settings, app_id, NEW) == 0
        assert len(await read(settings, names[NEW])) == len(carried)
    finally:
        await producer.stop()
        await admin.close()
        await asyncio.to_thread(drop_topics, settings.kafka_bootstrap, settings.topic_prefix)
