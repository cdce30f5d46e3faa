"""Ratings an earlier Conveyor counted in two tables carried into the one
ratings table on the real broker (workers/usage/run.py): every row and
latest rating as the old changelogs last held them, rows first, the old
changelogs deleted, and a second start that finds nothing to do."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from conveyor.settings import Settings, load_settings
from tests.unit.workers.usage.test_usage_ratings import NOW, Changelog, rating
from topics.admin import drop_topics
from topics.clients import make_consumer
from workers.usage.ratings import LATEST, Ratings
from workers.usage.run import OLD_LATEST, OLD_TOTALS, carry_old_ratings

NEW = "feedback-ratings"


def faust(value: Any) -> bytes:
    """A key or value as Faust's JSON serializer writes it."""
    return json.dumps(value).encode()


async def read(settings: Settings, topic: str) -> list[tuple[bytes, bytes]]:
    tp = TopicPartition(topic, 0)
    consumer = make_consumer(settings.kafka, group=None)
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
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    app_id = settings.kafka.group("accounting")
    # what today's table holds after these ratings; the old tables held the same
    # rows, and each latest rating under the bare request id
    today = Ratings({}, lambda: NOW)
    for offset, (rid, score) in enumerate([("a", 1.0), ("b", -1.0), ("a", 0.5)]):
        assert today.count(rating(rid, score), 0, offset)
    rows = {k: v for k, v in today.table.items() if not k.startswith(LATEST)}
    latest = {k[len(LATEST):]: v for k, v in today.table.items() if k.startswith(LATEST)}
    names = {t: f"{app_id}-{t}-changelog" for t in (OLD_TOTALS, OLD_LATEST, NEW)}
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap)
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
        await asyncio.to_thread(drop_topics, settings.kafka.bootstrap, settings.kafka.topic_prefix)


# --- a start killed part-way (the module's docstring) ------------------------------

ROOT = Path(__file__).resolve().parents[4]
# a start of the accounting app that gets as far as the copy: prefix, app id, table
CHILD = ("import asyncio, sys\n"
         "from conveyor.settings import load_settings\n"
         "from workers.usage.run import carry_old_ratings\n"
         "asyncio.run(carry_old_ratings(load_settings(topic_prefix=sys.argv[1]), sys.argv[2],"
         " sys.argv[3]))\n")


# writes to changelogs: (old table or topic, key, value), a tombstone's value None
Writes = list[tuple[str, bytes, bytes | None]]


def history(requests: int) -> tuple[dict[str, Any], Writes]:
    """What today's table holds after ``requests`` ratings, one tenant each and
    every tenth request rated again, and what the old tables' changelogs got
    for them, in the order they were written: (old table, key, value)."""
    changelog = Changelog()
    today = Ratings(changelog, lambda: NOW)
    offset = 0
    for again in (False, True):
        for i in range(0, requests, 10 if again else 1):
            score = -0.5 if again else 1.0
            assert today.count(rating(f"r{i}", score, tenant=f"t{i}", model=f"m{i % 7}",
                                      answered_by=f"d{i % 3}"), 0, offset)
            offset += 1
    old: Writes = [
        (OLD_LATEST, faust(k[len(LATEST):]), faust(v)) if k.startswith(LATEST)
        else (OLD_TOTALS, faust(k), faust(v)) for k, v in changelog.writes]
    old += [(OLD_TOTALS, faust("[\"gone\"]"), faust({"n": 1})),  # a row deleted since
            (OLD_TOTALS, faust("[\"gone\"]"), None)]
    return dict(changelog), old


async def old_tables(settings: Settings, requests: int
                     ) -> tuple[dict[str, str], dict[str, Any], Writes]:
    """The changelogs of the old tables (and the new one, empty) of a prefix of
    its own, the old ones written as ``history(requests)`` says: the topic of each
    table, what the new table should hold, the old writes."""
    app_id = settings.kafka.group("accounting")
    names = {t: f"{app_id}-{t}-changelog" for t in (OLD_TOTALS, OLD_LATEST, NEW)}
    table, old = history(requests)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, 1, 1) for n in names.values()])
    finally:
        await admin.close()
    await write(settings, [(names[t], k, v) for t, k, v in old])
    return names, table, old


async def write(settings: Settings, records: Writes) -> None:
    """``records`` (topic, key, value) in their order, acknowledged."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap, linger_ms=5,
                                enable_idempotence=True)
    await producer.start()
    try:
        sent = [await producer.send(topic, value, key=key, partition=0)
                for topic, key, value in records]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


async def gone(admin: AIOKafkaAdminClient, topics: set[str], within: float = 30) -> None:
    deadline = time.monotonic() + within
    while left := topics & set(await admin.list_topics()):
        assert time.monotonic() < deadline, f"not deleted: {sorted(left)}"
        await asyncio.sleep(0.2)


def restored(carried: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """The table Faust restores from its changelog: the last value of each key."""
    table: dict[str, Any] = {}
    for key, value in carried:
        if value is None:
            table.pop(json.loads(key), None)
        else:
            table[json.loads(key)] = json.loads(value)
    return table


def start_copy(settings: Settings, stderr: Path) -> subprocess.Popen[bytes]:
    with stderr.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-c", CHILD, settings.kafka.topic_prefix,
             settings.kafka.group("accounting"),
             NEW], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:]


async def kill_mid_copy(settings: Settings, names: dict[str, str], total: int,
                        stderr: Path) -> int | None:
    """Start the copy in a process of its own and SIGKILL it once part of the
    ``total`` records are in the new changelog: how many were (its end offset,
    after the kill), or None when the kill came too late (the copy had ended)."""
    tp = TopicPartition(names[NEW], 0)
    consumer = make_consumer(settings.kafka, group=None)
    await consumer.start()
    child = start_copy(settings, stderr)
    try:
        deadline = time.monotonic() + 30
        while True:
            end = (await consumer.end_offsets([tp]))[tp]
            if 0 < end < total:
                child.kill()  # SIGKILL
                break
            if child.poll() not in (None, 0):
                raise AssertionError(f"the copy failed ({child.returncode}): {tail(stderr)}")
            if end >= total or child.poll() is not None:
                return None  # the copy ended before it was seen under way
            assert time.monotonic() < deadline, \
                f"the copy did not start within 30 s: {tail(stderr)}"
            await asyncio.sleep(0.005)
        assert await asyncio.to_thread(child.wait, 10) == -signal.SIGKILL
        # a produce request the broker got before the kill may still be appended
        while True:
            await asyncio.sleep(0.5)
            end, before = (await consumer.end_offsets([tp]))[tp], end
            if end == before:
                return end if end < total else None
    finally:
        if child.poll() is None:
            child.kill()
            await asyncio.to_thread(child.wait, 10)
        await consumer.stop()


async def test_a_copy_killed_mid_way_is_done_again_on_the_next_start(
        services: None, tmp_path: Path) -> None:
    prefixes: list[str] = []
    admin: AIOKafkaAdminClient | None = None
    try:
        # a kill must land mid-copy; a copy that ended first is tried again, larger
        for requests in (4000, 8000, 16000):
            settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
            prefixes.append(settings.kafka.topic_prefix)
            names, table, old = await old_tables(settings, requests)
            total = len(table)
            killed_at = await kill_mid_copy(settings, names, total,
                                            tmp_path / f"{settings.kafka.topic_prefix}.stderr")
            if killed_at is not None:
                break
        else:
            pytest.fail("every copy ended before it could be killed part-way")
        assert 0 < killed_at < total
        app_id = settings.kafka.group("accounting")
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
        await admin.start()
        # killed before the deletes: the old totals say the copy is still to do
        assert {names[OLD_TOTALS], names[OLD_LATEST]} <= set(await admin.list_topics())
        assert len(restored(await read(settings, names[NEW]))) < total  # part of the table

        assert await carry_old_ratings(settings, app_id, NEW) == total
        carried = await read(settings, names[NEW])
        assert len(carried) == killed_at + total  # the kill's prefix, then the whole copy
        assert restored(carried) == table
        rows = sum(1 for k in table if not k.startswith(LATEST))
        assert {k[len(LATEST):] for k in table if k.startswith(LATEST)} == {
            json.loads(k) for t, k, _ in old if t == OLD_LATEST}
        assert not any(json.loads(k).startswith(LATEST) for k, _ in carried[killed_at:][:rows])
        await gone(admin, {names[OLD_TOTALS], names[OLD_LATEST]})
        assert await carry_old_ratings(settings, app_id, NEW) == 0
        assert len(await read(settings, names[NEW])) == len(carried)
    finally:
        if admin is not None:
            await admin.close()
        for prefix in prefixes:
            await asyncio.to_thread(drop_topics, load_settings().kafka.bootstrap, prefix)


async def test_a_start_between_the_two_deletes_carries_the_rows_again(services: None) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    app_id = settings.kafka.group("accounting")
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    try:
        names, table, old = await old_tables(settings, 200)
        assert await carry_old_ratings(settings, app_id, NEW) == len(table)
        first = await read(settings, names[NEW])
        assert restored(first) == table
        await gone(admin, {names[OLD_TOTALS], names[OLD_LATEST]})
        # what a kill between the two deletes leaves: the latest ratings' changelog
        # deleted, the totals' still there as it was
        deadline = time.monotonic() + 30
        while True:  # the broker may still be deleting the old one
            made = (await admin.create_topics([NewTopic(names[OLD_TOTALS], 1, 1)])).to_object()
            if all(t["error_code"] == 0 for t in made["topic_errors"]):
                break
            assert time.monotonic() < deadline, f"could not make the old totals again: {made}"
            await asyncio.sleep(0.2)
        totals = [(names[t], k, v) for t, k, v in old if t == OLD_TOTALS]
        await write(settings, totals)
        rows = {k: v for k, v in table.items() if not k.startswith(LATEST)}

        assert await carry_old_ratings(settings, app_id, NEW) == len(rows)
        carried = await read(settings, names[NEW])
        assert carried[:len(first)] == first
        assert len(carried) == len(first) + len(rows)
        assert restored(carried[len(first):]) == rows  # the rows again, and only them
        assert restored(carried) == table  # the latest ratings kept from the first copy
        await gone(admin, {names[OLD_TOTALS]})
        assert names[OLD_LATEST] not in set(await admin.list_topics())
        assert await carry_old_ratings(settings, app_id, NEW) == 0
        assert len(await read(settings, names[NEW])) == len(carried)
    finally:
        await admin.close()
        await asyncio.to_thread(drop_topics, settings.kafka.bootstrap, settings.kafka.topic_prefix)
