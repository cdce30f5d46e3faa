"""The Redis copy of the ledger, written by RedisMirror and read by UsageLedger,
on the real Redis under a prefix of the test's own."""

from __future__ import annotations

import datetime as dt
import time

import pytest
import redis.asyncio as aioredis

from conveyor.errors import InvalidRequest
from conveyor.settings import Settings
from tests.support.usage import quota_total
from topics.envelope import now_ms
from workers.usage import UsageLedger, UsageRow
from workers.usage.mirror import RedisMirror, UsageKeys
from workers.usage.rows import (
    DAY_MS,
    MINUTE_MS,
    TTFT_BUCKETS,
    Counts,
    Granularity,
    RowKey,
    bucket_start,
    expires_at,
    ttft_bucket,
)

NOW = now_ms()
M0 = bucket_start(NOW, "minute")
D0 = bucket_start(NOW, "day")
MONTH = bucket_start(NOW, "month")


def rows() -> list[tuple[RowKey, Counts]]:
    out: list[tuple[RowKey, Counts]] = []
    series: list[tuple[int, Granularity, int]] = [
        (M0, "minute", 1), (M0 - 3 * MINUTE_MS, "minute", 2), (D0, "day", 10),
        (D0 - 2 * DAY_MS, "day", 20)]
    for bucket, by, scale in series:
        out += [
            (RowKey(by, "tenant", bucket, "acme"), Counts(3 * scale, scale, 30 * scale,
                                                          6 * scale)),
            (RowKey(by, "key", bucket, "acme", "k1"), Counts(2 * scale, 0, 20 * scale,
                                                             4 * scale)),
            (RowKey(by, "key", bucket, "acme", "k2"), Counts(scale, scale, 10 * scale,
                                                             2 * scale)),
            (RowKey(by, "model", bucket, "acme", "m1"), Counts(3 * scale, scale, 30 * scale,
                                                               6 * scale)),
        ]
    out.append((RowKey("month", "tenant", MONTH, "acme"), Counts(90, 30, 900, 180)))
    out.append((RowKey("day", "tenant", D0, "other"), Counts(1, 0, 5, 5)))
    return out


async def test_the_quota_keys_hold_integer_totals_under_the_rate_limiters_names(
        settings: Settings, redis: aioredis.Redis) -> None:
    assert await RedisMirror(redis, UsageKeys(settings.kafka.topic_prefix)).write(rows()) == 18
    p = settings.kafka.topic_prefix
    today = dt.datetime.fromtimestamp(NOW / 1000, tz=dt.UTC)
    assert await redis.get(f"{p}:usage:acme:day:{today:%Y-%m-%d}") == b"360"
    assert await redis.get(f"{p}:usage:acme:month:{today:%Y-%m}") == b"1080"
    assert await redis.get(f"{p}:usage:other:day:{today:%Y-%m-%d}") == b"10"
    # every key expires with its bucket
    assert await redis.pexpiretime(f"{p}:usage:acme:day:{today:%Y-%m-%d}") == \
        expires_at(D0, "day")
    assert await redis.pexpiretime(UsageKeys(p).bucket("acme", "minute", M0)) == \
        expires_at(M0, "minute")
    ledger = UsageLedger(settings, redis)
    assert await quota_total(ledger, "acme", "day") == 360
    assert await quota_total(ledger, "acme", "month", at_ms=NOW) == 1080
    assert await quota_total(ledger, "acme", "day", at_ms=NOW - 2 * DAY_MS) == 720
    assert await quota_total(ledger, "nobody", "month") == 0


async def test_reports_by_day_and_minute_for_the_tenant_a_key_and_a_model(
        settings: Settings, redis: aioredis.Redis) -> None:
    await RedisMirror(redis, UsageKeys(settings.kafka.topic_prefix)).write(rows())
    ledger = UsageLedger(settings, redis)
    by_day = await ledger.report("acme", since_ms=NOW - 7 * DAY_MS, until_ms=NOW)
    assert by_day == [
        UsageRow(D0 - 2 * DAY_MS, 60, 20, 600, 120, 720),
        UsageRow(D0, 30, 10, 300, 60, 360),
    ]
    by_key = await ledger.report("acme", since_ms=NOW - 7 * DAY_MS, until_ms=NOW,
                                 key_id="k2")
    assert [(r.requests, r.errors, r.total_tokens) for r in by_key] == [(20, 20, 240),
                                                                       (10, 10, 120)]
    by_model = await ledger.report("acme", since_ms=NOW - DAY_MS, until_ms=NOW, model="m1")
    assert by_model == [UsageRow(D0, 30, 10, 300, 60, 360)]
    by_minute = await ledger.report("acme", since_ms=NOW - 10 * MINUTE_MS, until_ms=NOW + 1,
                                    by="minute", key_id="k1")
    assert by_minute == [UsageRow(M0 - 3 * MINUTE_MS, 4, 0, 40, 8, 48),
                         UsageRow(M0, 2, 0, 20, 4, 24)]
    # a bucket overlapping the start of the range is in; one before it is not
    last_two = await ledger.report("acme", since_ms=NOW - MINUTE_MS // 2, until_ms=NOW + 1,
                                   by="minute")
    assert [r.bucket_start_ms for r in last_two] == [M0]
    assert await ledger.report("acme", since_ms=NOW, until_ms=NOW - 1) == []
    assert await ledger.report("acme", since_ms=0, until_ms=NOW, model="unknown") == []
    assert by_day[1].as_dict() == {
        "bucket_start": f"{dt.datetime.fromtimestamp(NOW / 1000, tz=dt.UTC):%Y-%m-%d}T00:00:00Z",
        "bucket_start_ms": D0, "requests": 30, "errors": 10, "prompt_tokens": 300,
        "completion_tokens": 60, "total_tokens": 360}


async def test_writing_again_changes_nothing(settings: Settings,
                                            redis: aioredis.Redis) -> None:
    mirror = RedisMirror(redis, UsageKeys(settings.kafka.topic_prefix), batch=7)
    await mirror.write(rows())
    ledger = UsageLedger(settings, redis)
    first = await ledger.report("acme", since_ms=0, until_ms=NOW + 1, by="minute")
    await mirror.write(rows())
    assert await ledger.report("acme", since_ms=0, until_ms=NOW + 1, by="minute") == first
    assert await quota_total(ledger, "acme", "month") == 1080


async def test_a_report_names_one_key_or_one_model_not_both(
        settings: Settings, redis: aioredis.Redis) -> None:
    ledger = UsageLedger(settings, redis)
    with pytest.raises(InvalidRequest):
        await ledger.report("acme", since_ms=0, until_ms=NOW, key_id="k1", model="m1")
    with pytest.raises(InvalidRequest):
        await ledger.report("acme", since_ms=0, until_ms=NOW, by="month")  # type: ignore[arg-type]


def models_row(bucket: int, model: str, partition: int, counts: Counts,
               ttfts: list[int | None]) -> tuple[RowKey, Counts]:
    hist = [0] * TTFT_BUCKETS
    for ttft in ttfts:
        hist[ttft_bucket(ttft)] += 1
    return (RowKey("minute", "models", bucket, "", model, partition),
            Counts(counts.requests, counts.errors, counts.prompt_tokens,
                   counts.completion_tokens, tuple(hist)))


async def test_model_minutes_add_up_the_partitions_shares_with_their_ttft(
        settings: Settings, redis: aioredis.Redis) -> None:
    written = [
        models_row(M0, "m1", 0, Counts(2, 1, 20, 4), [100, None]),
        models_row(M0, "m1", 3, Counts(2, 0, 10, 6), [100, 110]),
        models_row(M0, "org/m:2", 1, Counts(1, 1, 5, 0), [None]),
        models_row(M0 - 2 * MINUTE_MS, "m1", 0, Counts(1, 0, 1, 1), [3_000]),
        models_row(M0 - 90 * MINUTE_MS, "m1", 0, Counts(9, 0, 9, 9), [50] * 9),
    ]
    await RedisMirror(redis, UsageKeys(settings.kafka.topic_prefix)).write(
        [*written, *rows()])
    ledger = UsageLedger(settings, redis)
    got = await ledger.model_minutes(since_ms=M0 - 60 * MINUTE_MS, until_ms=M0 + MINUTE_MS)
    assert sorted(got) == ["m1", "org/m:2"]
    older, newest = got["m1"]
    assert older.bucket_start_ms == M0 - 2 * MINUTE_MS and newest.bucket_start_ms == M0
    assert (newest.requests, newest.errors, newest.prompt_tokens,
            newest.completion_tokens) == (4, 1, 30, 10)
    # 100, 100 and 110 ms: all in the bucket [80, 160)
    assert newest.ttft_p50_ms is not None and 80 <= newest.ttft_p50_ms <= 160
    assert newest.ttft_p99_ms is not None and newest.ttft_p50_ms < newest.ttft_p99_ms <= 160
    assert older.ttft_p50_ms is not None and 2_560 <= older.ttft_p50_ms <= 5_120
    # a minute whose requests had no first token: no percentile
    [alone] = got["org/m:2"]
    assert alone.requests == 1 and alone.ttft_p50_ms is None and alone.ttft_p99_ms is None
    # a minute's hash expires with the minute rows
    assert await redis.pexpiretime(UsageKeys(settings.kafka.topic_prefix).models(M0)) == \
        expires_at(M0, "minute")
    assert await ledger.model_minutes(since_ms=M0, until_ms=M0) == {}


async def test_an_hour_of_model_minutes_answers_in_one_round_trip(
        settings: Settings, redis: aioredis.Redis) -> None:
    written = [models_row(M0 - i * MINUTE_MS, f"model-{m}", p, Counts(5, 1, 50, 20),
                          [100, 200, 400, None, 800])
               for i in range(60) for m in range(5) for p in range(4)]
    await RedisMirror(redis, UsageKeys(settings.kafka.topic_prefix)).write(written)
    ledger = UsageLedger(settings, redis)
    await ledger.model_minutes(since_ms=M0 - 59 * MINUTE_MS, until_ms=M0 + MINUTE_MS)  # warm
    started = time.perf_counter()
    got = await ledger.model_minutes(since_ms=M0 - 59 * MINUTE_MS, until_ms=M0 + MINUTE_MS)
    took = time.perf_counter() - started
    assert len(got) == 5 and all(len(minutes) == 60 for minutes in got.values())
    assert all(m.requests == 20 for minutes in got.values() for m in minutes)
    assert took < 0.1, f"an hour of 5 models took {took * 1000:.0f} ms"
