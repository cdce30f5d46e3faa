"""The request index and the model-wide minutes of a running accounting app
(``conveyor accounting`` in a process of its own, with a redis-server of its
own: the harness of test_usage_app.py): records it counts appear in both;
after a SIGKILL mid-stream and after a Redis FLUSHALL every request id is in
the index once and the model minutes add up to the records.

The tests run in order on one app, as in test_usage_app.py."""
# the harness's module fixture is imported by its name, which the tests then take
# ruff: noqa: F811

from __future__ import annotations

import random
import signal
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from schemas.records import UsageRecord
from tests.faults.workers.usage.test_usage_app import (  # noqa: F401
    Accounting,
    accounting,
    backlog,
    committed_to_end,
    eventually,
    produce,
)
from topics.envelope import now_ms
from workers.usage import UsageLedger
from workers.usage.requests import IndexKeys, RequestIndex, RequestRow
from workers.usage.rows import ttft_bucket


@pytest.fixture
async def client(accounting: Accounting) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.from_url(accounting.redis.url)
    try:
        yield redis
    finally:
        await redis.aclose()


def record(rid: str, tenant: str, model: str, *, key_id: str = "k1",
           status: str = "completed", ttft: int | None = 150, prompt: int = 10,
           completion: int = 5) -> UsageRecord:
    now = now_ms()
    return UsageRecord(request_id=rid, tenant=tenant, key_id=key_id, model=model, kind="chat",
                       status=status, prompt_tokens=prompt, completion_tokens=completion,
                       entered_ms=now - 2_000, finished_ms=now,
                       first_token_ms=None if ttft is None else now - 2_000 + ttft)


async def minutes_of(ledger: UsageLedger, model: str) -> tuple[int, int, int, int]:
    now = now_ms()
    got = (await ledger.model_minutes(since_ms=now - 3_600_000, until_ms=now + 1)).get(model, [])
    return (sum(m.requests for m in got), sum(m.errors for m in got),
            sum(m.prompt_tokens for m in got), sum(m.completion_tokens for m in got))


async def indexed(client: aioredis.Redis, accounting: Accounting, model: str) -> list[str]:
    """The ids in the model's set, each once (a sorted set), and each with its row."""
    keys = IndexKeys(accounting.settings.kafka.topic_prefix)
    ids = [i.decode() for i in await client.zrange(keys.finished("model", model), 0, -1)]
    rows = await client.mget([keys.row(i) for i in ids]) if ids else []
    return [i for i, row in zip(ids, rows, strict=True) if row is not None]


async def test_counted_records_appear_in_the_index_and_the_model_minutes(
        accounting: Accounting, client: aioredis.Redis) -> None:
    s = accounting.settings
    ledger = UsageLedger(s, client)
    index = RequestIndex(s, client)
    first = record("ix-1", "ix-a", "ix-m1", ttft=120)
    await produce(s, first,
                  record("ix-2", "ix-b", "ix-m1", key_id="k2", ttft=130, prompt=20),
                  record("ix-3", "ix-a", "ix-m1", status="error", ttft=None, completion=0),
                  record("ix-4", "ix-c", "ix-m2", ttft=5_000),
                  record("ix-1", "ix-a", "ix-m1", ttft=9_999))  # postprocess wrote it twice

    async def seen() -> bool:
        return (await minutes_of(ledger, "ix-m2"))[0] == 1 \
            and len(await indexed(client, accounting, "ix-m1")) == 3 \
            and (await index.search(model="ix-m2")).rows != []

    await eventually(seen, 90, accounting)  # the first start of Faust included
    assert await index.get("ix-1") == RequestRow.of(first)
    page = await index.search(tenant="ix-a")
    assert [r.request_id for r in page.rows] == ["ix-3", "ix-1"] and not page.more
    assert [r.request_id for r in (await index.search(status="error", model="ix-m1")).rows] \
        == ["ix-3"]
    assert [r.request_id for r in (await index.search(limit=4)).rows] == \
        ["ix-4", "ix-3", "ix-2", "ix-1"]

    async def complete() -> bool:
        return (await index.search(limit=1)).complete

    await eventually(complete, 30, accounting)

    # seen() waits for ix-c's partition only, and Redis gets the rows counted
    # before each mirror tick: on a loaded machine ix-a's and ix-b's partitions
    # were counted 0.2 s after ix-c's, past a tick, and ix-m1's minutes read
    # (0, 0, 0, 0) here, right 0.24 s later (the app's debug log: every record
    # counted within 0.25 s, no stall). So: every record handled (committed),
    # then the mirror's next tick
    async def handled() -> bool:
        return await committed_to_end(s)

    async def mirrored() -> bool:
        return (await minutes_of(ledger, "ix-m1"))[0] >= 3

    await eventually(handled, 30, accounting)
    await eventually(mirrored, 10, accounting)
    # every tenant's requests of a model, in its minutes, counted once
    assert await minutes_of(ledger, "ix-m1") == (3, 1, 40, 10)
    now = now_ms()
    got = await ledger.model_minutes(since_ms=now - 3_600_000, until_ms=now + 1)
    m1 = got["ix-m1"]
    # 120 and 130 ms, both in [80, 160); the error had no first token
    assert all(m.ttft_p50_ms is not None and 80 <= m.ttft_p50_ms <= 160 for m in m1)
    [m2] = got["ix-m2"]
    assert m2.ttft_p99_ms is not None and ttft_bucket(int(m2.ttft_p99_ms)) == ttft_bucket(5_000)


async def test_a_kill_mid_stream_and_a_flush_leave_each_request_indexed_once(
        accounting: Accounting, client: aioredis.Redis) -> None:
    s = accounting.settings
    ledger = UsageLedger(s, client)
    index = RequestIndex(s, client)
    n = 1200
    rng = random.Random(3)
    records = [record(f"kx-{i}", f"kx-{i % 5}", "kx-m", key_id=f"k{i % 7}",
                      status="error" if i % 10 == 0 else "completed",
                      ttft=None if i % 10 == 0 else rng.randrange(20, 4_000),
                      prompt=1 + i % 4, completion=0 if i % 10 == 0 else 2)
               for i in range(n)]
    # and copies postprocess wrote again, beside their first (counted once)
    await backlog(s, records[:600] + records[100:110] + records[600:])
    want = (n, n // 10, sum(r["prompt_tokens"] for r in records),
            sum(r["completion_tokens"] for r in records))
    ids = {r["request_id"] for r in records}

    async def some() -> bool:
        return (await minutes_of(ledger, "kx-m"))[0] >= n // 10

    await eventually(some, 60, accounting)
    assert accounting.signal(signal.SIGKILL) == -signal.SIGKILL
    accounting.start()

    async def whole() -> bool:
        return await minutes_of(ledger, "kx-m") == want \
            and len(await indexed(client, accounting, "kx-m")) == n

    await eventually(whole, 120, accounting)
    assert set(await indexed(client, accounting, "kx-m")) == ids

    accounting.redis.flush()
    assert not (await index.search(limit=1)).complete  # no partition marked indexed now

    async def rebuilt() -> bool:
        return (await index.search(limit=1)).complete \
            and await minutes_of(ledger, "kx-m") == want \
            and len(await indexed(client, accounting, "kx-m")) == n

    await eventually(rebuilt, 60, accounting)
    assert set(await indexed(client, accounting, "kx-m")) == ids
    # the rows of the earlier test were read back from the topic too
    assert [r.request_id for r in (await index.search(tenant="ix-a")).rows] == ["ix-3", "ix-1"]
    errors = await index.search(model="kx-m", status="error", limit=1000)
    assert len(errors.rows) == n // 10 and not errors.more
    assert all(r.first_token_ms is None for r in errors.rows)


async def test_sigterm_stops_the_app_cleanly(accounting: Accounting) -> None:
    assert accounting.signal(signal.SIGTERM) == 0
    assert "Traceback" not in accounting.log(), accounting.log()[-3000:]
