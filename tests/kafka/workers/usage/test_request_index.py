"""The request index on the real Redis, under a prefix of the test's own:
written by IndexWriter, searched and read by RequestIndex."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from conveyor.errors import InvalidRequest
from conveyor.redis_clients import REDIS_ERRORS
from conveyor.settings import Settings
from schemas.codec import default_codec
from schemas.records import UsageRecord
from tests.support.services import free_port
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import make_producer
from topics.envelope import now_ms
from workers.usage.requests import (
    SCAN_LIMIT,
    IndexFeed,
    IndexKeys,
    IndexWriter,
    RequestIndex,
    RequestRow,
    index_retention_ms,
)
from workers.usage.rows import DAY_MS

NOW = now_ms()


def row(i: int, *, tenant: str = "acme", key_id: str = "k1", model: str = "m1",
        status: str = "completed", finished: int | None = None) -> RequestRow:
    done = NOW - 1_000 * i if finished is None else finished
    return RequestRow(f"r{i}", tenant, key_id, model, "chat", status, 10, 5, done - 400,
                      done, None if status == "error" else done - 300)


def usage(rid: str) -> UsageRecord:
    return UsageRecord(request_id=rid, tenant="acme", key_id="k1", model="m1", kind="chat",
                       status="completed", prompt_tokens=1, completion_tokens=1,
                       entered_ms=NOW - 500, finished_ms=NOW, first_token_ms=NOW - 400)


async def write(settings: Settings, redis: aioredis.Redis, rows: list[RequestRow]) -> int:
    return await IndexWriter(redis, IndexKeys(settings.kafka.topic_prefix),
                             index_retention_ms(settings)).write(rows)


async def mark_all(settings: Settings, redis: aioredis.Redis) -> None:
    keys = IndexKeys(settings.kafka.topic_prefix)
    await redis.hset(keys.marks(), mapping={
        str(p): 0 for p in range(settings.kafka.pipeline_partitions)})


async def test_the_tail_is_the_latest_finished_and_filters_combine(
        settings: Settings, redis: aioredis.Redis) -> None:
    rows = [row(i, tenant="acme" if i % 2 else "zeta", key_id=f"k{i % 3}",
                model="m1" if i % 5 else "m2", status="error" if i % 7 == 0 else "completed")
            for i in range(100)]
    assert await write(settings, redis, rows) == 100
    index = RequestIndex(settings, redis)
    tail = await index.search(limit=10)
    assert [r.request_id for r in tail.rows] == [f"r{i}" for i in range(10)]
    assert tail.more and not tail.complete  # no partition marked indexed yet
    await mark_all(settings, redis)
    every = await index.search(limit=1000)
    assert len(every.rows) == 100 and not every.more and every.complete

    def expect(pick: object) -> list[str]:
        return [r.request_id for r in rows if pick(r)]  # type: ignore[operator]

    page = await index.search(tenant="acme", status="error", limit=100)
    assert [r.request_id for r in page.rows] == expect(
        lambda r: r.tenant == "acme" and r.status == "error")
    page = await index.search(key_id="k2", model="m2", limit=100)
    assert [r.request_id for r in page.rows] == expect(
        lambda r: r.key_id == "k2" and r.model == "m2")
    page = await index.search(tenant="zeta", key_id="k0", model="m1", status="completed",
                              limit=3)
    assert [r.request_id for r in page.rows] == expect(
        lambda r: r.tenant == "zeta" and r.key_id == "k0" and r.model == "m1"
        and r.status == "completed")[:3]
    assert page.more
    # the time window is of finished_ms, since included, until not
    page = await index.search(since_ms=NOW - 20_000, until_ms=NOW - 10_000, limit=100)
    assert [r.request_id for r in page.rows] == [f"r{i}" for i in range(11, 21)]
    assert (await index.search(tenant="nobody")).rows == []
    assert (await index.search(since_ms=NOW, until_ms=NOW - 5)).rows == []


async def test_writing_a_record_again_leaves_the_same_index_first_copy_kept(
        settings: Settings, redis: aioredis.Redis) -> None:
    first = row(1)
    await write(settings, redis, [first, row(2)])
    # postprocess's second copy of r1, after a crash: later, and (say) an error
    again = RequestRow(**{**first.__dict__, "finished_ms": first.finished_ms + 5_000,
                          "status": "error"})
    await write(settings, redis, [first, again, row(2)])
    index = RequestIndex(settings, redis)
    assert await index.get("r1") == first
    page = await index.search(limit=10)
    assert [r.request_id for r in page.rows] == ["r1", "r2"]
    assert (await index.search(status="error")).rows == []
    assert await index.get("r9") is None
    assert await index.rows(["r2", "r9", "r1"]) == [row(2), None, first]
    assert await index.rows([]) == []


async def test_rows_past_the_retention_are_neither_written_nor_kept(
        settings: Settings, redis: aioredis.Redis) -> None:
    keys = IndexKeys(settings.kafka.topic_prefix)
    kept = index_retention_ms(settings)
    old = row(1, finished=NOW - kept - 1_000)
    assert await write(settings, redis, [old, row(2)]) == 1
    assert await redis.exists(keys.row("r1")) == 0
    # one written while it was young, trimmed by a later write to its sets
    await redis.zadd(keys.finished(), {"r0": NOW - 8 * DAY_MS})
    await write(settings, redis, [row(3)])
    assert await redis.zscore(keys.finished(), "r0") is None
    assert await redis.pexpiretime(keys.row("r2")) == row(2).finished_ms + kept
    assert 0 < await redis.pttl(keys.finished("tenant", "acme")) <= kept


async def test_a_shorter_retention_is_what_is_kept_and_what_is_searched(
        settings: Settings, redis: aioredis.Redis) -> None:
    short = settings.replace(request_index_days=1)
    keys = IndexKeys(short.kafka.topic_prefix)
    writer = IndexWriter(redis, keys, index_retention_ms(short))
    two_days_old = row(1, finished=NOW - 2 * DAY_MS)
    assert await writer.write([two_days_old, row(2)]) == 1
    assert await redis.pexpiretime(keys.row("r2")) == row(2).finished_ms + DAY_MS
    # a row the week-long index kept before the setting changed is not found
    await write(settings, redis, [two_days_old])
    await mark_all(short, redis)
    page = await RequestIndex(short, redis).search()
    assert [r.request_id for r in page.rows] == ["r2"] and page.complete


async def test_a_filter_walk_is_bounded_and_says_there_may_be_more(
        settings: Settings, redis: aioredis.Redis) -> None:
    # two big sets, their intersection further back in each than the bound
    newer = SCAN_LIMIT + 100
    rows = [row(i, tenant="acme", key_id="k1", finished=NOW - 10 * i) for i in range(newer)]
    rows += [row(newer + i, tenant="zeta", key_id="k2", finished=NOW - 10 * i - 1)
             for i in range(newer)]
    rows += [row(2 * newer + i, tenant="acme", key_id="k2", finished=NOW - 10 * (newer + i))
             for i in range(10)]
    await write(settings, redis, rows)
    index = RequestIndex(settings, redis)
    page = await index.search(tenant="acme", key_id="k2", limit=10)
    assert page.rows == [] and page.more
    with pytest.raises(InvalidRequest, match="limit"):
        await index.search(limit=0)


async def test_every_search_finds_what_matches_newest_first(
        settings: Settings, redis: aioredis.Redis) -> None:
    """Each filter alone and combined, and a time window, over rows spread across
    many values: exactly the matching rows, newest first, a page's worth. How
    fast they answer with 100,000 requests indexed is measured by
    ``bench.streams --soak 100000 --console`` (docs/benchmarks/results/console.md)."""
    tenants, keys, models = 7, 30, 5
    rows = [row(i, tenant=f"t{i % tenants}", key_id=f"k{i % keys}", model=f"m{i % models}",
                status="error" if i % 50 == 0 else "completed", finished=NOW - 5 * i)
            for i in range(5_000)]
    await write(settings, redis, rows)
    index = RequestIndex(settings, redis)
    searches: list[dict[str, Any]] = [
        {}, {"tenant": "t3"}, {"key_id": "k17"}, {"model": "m2"}, {"status": "error"},
        {"tenant": "t0", "status": "error"}, {"tenant": "t1", "model": "m1"},
        {"key_id": "k3", "model": "m3", "status": "completed"},
        {"tenant": "t2", "since_ms": NOW - 10_000, "until_ms": NOW - 5_000}]
    for filters in searches:
        page = await index.search(**filters)
        wanted = [r.request_id for r in rows  # rows are newest first already
                  if all(getattr(r, name) == value for name, value in filters.items()
                         if not name.endswith("_ms"))
                  and filters.get("since_ms", 0) <= r.finished_ms
                  < filters.get("until_ms", NOW + 1)]
        assert [r.request_id for r in page.rows] == wanted[:50], filters
        assert page.more == (len(wanted) > 50), filters


async def settle(feed: IndexFeed, held: list[int], within: float = 20.0) -> None:
    """Ticks until every partition of ``held`` is caught up and written."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        await feed.tick(held)
        if feed.complete_for(held) and not feed.tasks:
            await feed.tick(held)  # the marks follow what the last tick wrote
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not caught up within {within} s: {feed.tasks}")


async def test_a_feed_catches_up_from_its_mark_and_rebuilds_without_one(
        settings: Settings, redis: aioredis.Redis) -> None:
    topic = settings.kafka.topic("usage")
    await ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name == topic])
    codec = default_codec()

    async def send(*offsets: int) -> None:
        producer = make_producer(settings.kafka)
        await producer.start()
        try:
            for i in offsets:
                value = b"poison" if i in (5, 31) else codec.encode("UsageRecord", usage(f"c{i}"))
                await producer.send_and_wait(topic, value, key=b"acme", partition=0)
        finally:
            await producer.stop()

    await send(*range(30))
    keys = IndexKeys(settings.kafka.topic_prefix)
    index = RequestIndex(settings, redis)
    # a run before this one indexed up to offset 10 (and counted further: the
    # app's commits need not wait for the index)
    await redis.hset(keys.marks(), "0", "10")
    feed = IndexFeed(settings, redis)
    try:
        await settle(feed, [0])
        assert await redis.hget(keys.marks(), "0") == b"30"
        ids = {i.decode() for i in await redis.zrange(keys.finished(), 0, -1)}
        assert ids == {f"c{i}" for i in range(10, 30)}  # read from the mark on
        # what the app reads next is written at the next tick, and the mark follows
        await send(30, 31)
        feed.add(0, 30, usage("c30"))
        feed.add(0, 31, None)  # not a usage record: nothing to write, the mark moves on
        assert await feed.tick([0]) == 1
        assert await redis.hget(keys.marks(), "0") == b"32"
        assert await index.get("c30") == RequestRow.of(usage("c30"))
        # Redis lost everything: the next tick sees the mark gone, the index is
        # incomplete until the partition is read again within the retention
        await redis.delete(*[k async for k in redis.scan_iter(match=f"{keys.prefix}:*",
                                                               count=1000)])
        await feed.tick([0])
        assert not feed.complete_for([0])
        assert not (await index.search()).complete
        await settle(feed, [0])
        assert await redis.hget(keys.marks(), "0") == b"32"
        ids = {i.decode() for i in await redis.zrange(keys.finished(), 0, -1)}
        assert ids == {f"c{i}" for i in range(31) if i != 5}
    finally:
        await feed.close()


async def test_rows_wait_for_a_redis_that_fails_and_are_kept_in_order(
        settings: Settings) -> None:
    dead = aioredis.Redis(port=free_port(), socket_connect_timeout=0.5)
    feed = IndexFeed(settings, dead)
    feed.add(0, 7, usage("w1"))
    feed.add(1, 3, usage("w2"))
    with pytest.raises(REDIS_ERRORS):
        await feed.tick([0, 1])
    feed.add(0, 8, usage("w3"))
    assert [r.request_id for r in feed.pending[0]] == ["w1", "w3"]
    assert [r.request_id for r in feed.pending[1]] == ["w2"]
    # a partition given away takes its rows with it (its next holder reads them)
    feed.forget(1)
    assert 1 not in feed.pending
    await feed.close()
    await dead.aclose()
