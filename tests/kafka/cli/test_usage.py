"""``conveyor usage`` and ``conveyor accounting`` through the parser that
register() builds, reading a ledger written to the real Redis under a prefix
of the test's own. (Running ``conveyor accounting`` itself, and its SIGTERM,
is tests/workers/usage/test_usage_app.py.)"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from cli.usage import cmd_accounting, cmd_usage, register
from conveyor.settings import Settings, load_settings
from topics.envelope import now_ms
from topics.lookup import parse_since
from workers.usage.mirror import RedisMirror, UsageKeys
from workers.usage.rows import DAY_MS, MINUTE_MS, Counts, RowKey, bucket_start


@dataclass(frozen=True)
class Written:
    """The usage rows a test reads, written around the test's own now (not the
    module's import: the suite may reach this test many minutes after it)."""

    settings: Settings
    m0: int  # this minute's bucket
    d0: int  # today's bucket


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor")
    register(p.add_subparsers(dest="command", required=True))
    return p


@pytest.fixture
def written(services: None) -> Iterator[Written]:
    s = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    now = now_ms()
    M0, D0 = bucket_start(now, "minute"), bucket_start(now, "day")
    rows = [
        (RowKey("minute", "tenant", M0 - 2 * MINUTE_MS, "acme"), Counts(2, 1, 20, 4)),
        (RowKey("minute", "tenant", M0, "acme"), Counts(1, 0, 10, 5)),
        (RowKey("minute", "key", M0, "acme", "k1"), Counts(1, 0, 10, 5)),
        (RowKey("day", "tenant", D0 - DAY_MS, "acme"), Counts(7, 2, 70, 30)),
        (RowKey("day", "tenant", D0, "acme"), Counts(3, 1, 30, 9)),
        (RowKey("day", "model", D0, "acme", "m1"), Counts(2, 0, 25, 8)),
    ]

    async def write() -> None:
        redis = aioredis.from_url(s.redis.url)
        await RedisMirror(redis, UsageKeys(s.kafka.topic_prefix)).write(rows)
        await redis.aclose()

    async def clean() -> None:
        redis = aioredis.from_url(s.redis.url)
        keys = [k async for k in redis.scan_iter(match=f"{s.kafka.topic_prefix}:*", count=1000)]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()

    asyncio.run(write())
    try:
        yield Written(s, M0, D0)
    finally:
        asyncio.run(clean())


def test_times_are_dates_times_durations_before_now_or_now() -> None:
    now = 1_800_000_000_000
    assert parse_since("2026-11-01", now) == int(
        dt.datetime(2026, 11, 1, tzinfo=dt.UTC).timestamp() * 1000)
    assert parse_since("2026-11-01T12:30Z", now) == int(
        dt.datetime(2026, 11, 1, 12, 30, tzinfo=dt.UTC).timestamp() * 1000)
    assert parse_since("2026-11-01T12:30+01:00", now) == int(
        dt.datetime(2026, 11, 1, 11, 30, tzinfo=dt.UTC).timestamp() * 1000)
    assert parse_since("90m", now) == now - 90 * 60_000
    assert parse_since("24h", now) == now - DAY_MS
    assert parse_since("7d", now) == now - 7 * DAY_MS
    assert parse_since("now", now) == now
    with pytest.raises(ValueError):
        parse_since("yesterday", now)


def test_the_commands_and_their_options() -> None:
    args = parser().parse_args(["usage", "--tenant", "acme", "--key", "k1", "--since", "24h",
                                "--by", "minute", "--json"])
    assert args.func is cmd_usage
    assert (args.tenant, args.key_id, args.model, args.since, args.until, args.by,
            args.json) == ("acme", "k1", None, "24h", "now", "minute", True)
    assert parser().parse_args(["accounting"]).func is cmd_accounting
    with pytest.raises(SystemExit):  # one key or one model, not both
        parser().parse_args(["usage", "--tenant", "a", "--key", "k", "--model", "m"])
    with pytest.raises(SystemExit):
        parser().parse_args(["usage"])


def run(settings: Settings, *argv: str) -> int:
    args = parser().parse_args(list(argv))
    result: int = args.func(settings, args)
    return result


def test_a_table_by_day_one_bucket_per_line_with_a_total(
        written: Written, capsys: pytest.CaptureFixture[str]) -> None:
    settings, D0 = written.settings, written.d0
    assert run(settings, "usage", "--tenant", "acme", "--since", "7d") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["bucket", "(UTC)", "requests", "errors", "prompt",
                                "completion", "total"]
    yesterday = dt.datetime.fromtimestamp((D0 - DAY_MS) / 1000, tz=dt.UTC)
    today = dt.datetime.fromtimestamp(D0 / 1000, tz=dt.UTC)
    assert [line.split() for line in lines[1:]] == [
        [f"{yesterday:%Y-%m-%d}", "7", "2", "70", "30", "100"],
        [f"{today:%Y-%m-%d}", "3", "1", "30", "9", "39"],
        ["total", "10", "3", "100", "39", "139"],
    ]


def test_json_by_minute_for_one_key(written: Written,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    settings, M0 = written.settings, written.m0
    assert run(settings, "usage", "--tenant", "acme", "--by", "minute", "--since", "10m",
               "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["bucket_start_ms"], r["requests"], r["total_tokens"]) for r in report["rows"]] \
        == [(M0 - 2 * MINUTE_MS, 2, 24), (M0, 1, 15)]
    assert report["total"] == {"requests": 3, "errors": 1, "prompt_tokens": 30,
                               "completion_tokens": 9, "total_tokens": 39}
    assert run(settings, "usage", "--tenant", "acme", "--by", "minute", "--key", "k1",
               "--json") == 0
    by_key = json.loads(capsys.readouterr().out)
    assert by_key["key_id"] == "k1"
    assert [r["bucket_start_ms"] for r in by_key["rows"]] == [M0]
    assert run(settings, "usage", "--tenant", "acme", "--model", "m1", "--json") == 0
    assert json.loads(capsys.readouterr().out)["total"]["total_tokens"] == 33


def test_a_bad_time_is_refused_with_status_2(written: Written,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert run(written.settings, "usage", "--tenant", "acme", "--since", "last week") == 2
    assert "not a date" in capsys.readouterr().err
