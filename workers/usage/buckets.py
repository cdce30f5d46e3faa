"""The time buckets of the usage ledger: UTC minutes, days and months.

A request is counted in the buckets of the time it *finished*
(``UsageRecord.finished_ms``): that is when its tokens were spent, and it is
the time the quota check asks about. Every bucket is named by its start in
epoch milliseconds; days and months are UTC, the same calendar the rate
limiter's quota keys use.

How long a bucket is kept (in the accounting app's tables and in Redis):
minutes for two days, days for 400 days (a year and its month of overlap),
months as long as days plus the month itself. A bucket is gone once
``start + retention`` has passed.
"""

from __future__ import annotations

import datetime as dt
from typing import Literal, get_args

__all__ = ["Granularity", "GRANULARITIES", "MINUTE_MS", "DAY_MS", "RETENTION_MS", "bucket_start",
           "next_bucket", "expires_at", "is_expired", "day_label", "month_label"]

# what a report is bucketed by; "month" exists only for the tenant's quota total
Granularity = Literal["minute", "day", "month"]
GRANULARITIES: tuple[Granularity, ...] = get_args(Granularity)

MINUTE_MS = 60_000
DAY_MS = 24 * 3600 * 1000

RETENTION_MS: dict[Granularity, int] = {
    "minute": 2 * DAY_MS,
    "day": 400 * DAY_MS,
    "month": 431 * DAY_MS,
}


def _utc(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def _ms(moment: dt.datetime) -> int:
    return int(moment.timestamp()) * 1000


def bucket_start(ms: int, by: Granularity) -> int:
    """The start (epoch ms) of the bucket of ``by`` that holds ``ms``."""
    if by == "minute":
        return ms - ms % MINUTE_MS
    if by == "day":
        return ms - ms % DAY_MS
    moment = _utc(ms)
    return _ms(dt.datetime(moment.year, moment.month, 1, tzinfo=dt.UTC))


def next_bucket(start: int, by: Granularity) -> int:
    """The start of the bucket after the one that starts at ``start``."""
    if by == "minute":
        return start + MINUTE_MS
    if by == "day":
        return start + DAY_MS
    moment = _utc(start)
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return _ms(dt.datetime(year, month, 1, tzinfo=dt.UTC))


def expires_at(start: int, by: Granularity) -> int:
    """When the bucket that starts at ``start`` is dropped (epoch ms)."""
    return start + RETENTION_MS[by]


def is_expired(start: int, by: Granularity, now_ms: int) -> bool:
    return expires_at(start, by) <= now_ms


def day_label(ms: int) -> str:
    """``YYYY-MM-DD`` (UTC) of ``ms``: the name of the day in the quota keys."""
    return _utc(ms).strftime("%Y-%m-%d")


def month_label(ms: int) -> str:
    """``YYYY-MM`` (UTC) of ``ms``: the name of the month in the quota keys."""
    return _utc(ms).strftime("%Y-%m")
