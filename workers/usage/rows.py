"""The rows of the usage ledger and their UTC time buckets (minute, day, month;
each named by its start in epoch ms, dropped past its retention). A key is
the JSON text of ``[by, dim, bucket_ms, tenant, id]``, a value the counts
and the position of the last event counted in it
(docs/decisions/0002-faust-on-the-cold-path-only.md)."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Granularity", "MINUTE_MS", "DAY_MS", "RETENTION_MS", "bucket_start", "next_bucket",
           "expires_at", "is_expired", "day_label", "month_label", "Dimension", "RowKey",
           "Counts", "rows_of"]


# what a report is bucketed by; "month" exists only for the tenant's quota total
Granularity = Literal["minute", "day", "month"]

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


Dimension = Literal["tenant", "key", "model"]
_REPORTED: tuple[Granularity, ...] = ("minute", "day")


@dataclass(frozen=True)
class RowKey:
    by: Granularity
    dim: Dimension
    bucket_ms: int
    tenant: str
    ident: str = ""  # the key id or the model; "" for the tenant's own row

    def text(self) -> str:
        return json.dumps([self.by, self.dim, self.bucket_ms, self.tenant, self.ident],
                          separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> RowKey:
        by, dim, bucket_ms, tenant, ident = json.loads(text)
        return cls(by=by, dim=dim, bucket_ms=int(bucket_ms), tenant=tenant, ident=ident)


@dataclass(frozen=True)
class Counts:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, other: Counts) -> Counts:
        return Counts(self.requests + other.requests, self.errors + other.errors,
                      self.prompt_tokens + other.prompt_tokens,
                      self.completion_tokens + other.completion_tokens)

    def value(self, partition: int, offset: int) -> dict[str, int]:
        """The table value: the counts and the position of the last event in them."""
        return {"r": self.requests, "e": self.errors, "pt": self.prompt_tokens,
                "ct": self.completion_tokens, "p": partition, "o": offset}

    @classmethod
    def from_value(cls, value: Any) -> Counts:
        return cls(int(value["r"]), int(value["e"]), int(value["pt"]), int(value["ct"]))

    @classmethod
    def of(cls, record: Any) -> Counts:
        """What one UsageRecord adds to each of its rows."""
        return cls(requests=1, errors=1 if record["status"] == "error" else 0,
                   prompt_tokens=max(0, int(record["prompt_tokens"])),
                   completion_tokens=max(0, int(record["completion_tokens"])))


def rows_of(record: Any) -> list[RowKey]:
    """Every row one UsageRecord counts in: three dimensions by minute and by
    day, and the tenant's month."""
    at = int(record["finished_ms"])
    tenant = record["tenant"]
    keys: list[RowKey] = []
    for by in _REPORTED:
        start = bucket_start(at, by)
        keys.append(RowKey(by, "tenant", start, tenant))
        keys.append(RowKey(by, "key", start, tenant, record["key_id"]))
        keys.append(RowKey(by, "model", start, tenant, record["model"]))
    keys.append(RowKey("month", "tenant", bucket_start(at, "month"), tenant))
    return keys
