"""The rows of the usage ledger and their UTC time buckets (minute, day, month;
each named by its start in epoch ms, dropped past its retention). A key is
the JSON text of ``[by, dim, bucket_ms, tenant, id]`` (a model-wide minute
row: ``[by, "models", bucket_ms, "", model, partition]``), a value the counts
and the position of the last event counted in it; a model-wide row also
holds a histogram of the time to first token
(docs/decisions/0002-faust-on-the-cold-path-only.md)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

__all__ = ["Granularity", "MINUTE_MS", "DAY_MS", "RETENTION_MS", "bucket_start", "next_bucket",
           "expires_at", "is_expired", "day_label", "month_label", "Dimension", "RowKey",
           "Counts", "rows_of", "TTFT_BOUNDS_MS", "TTFT_BUCKETS", "TTFT_NONE", "ttft_bucket",
           "ttft_histogram", "ttft_percentile"]


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


# "models": a model over every tenant, by minute, one row per usage
# partition (a row lives in the partition its events come from); its tenant
# is "", and no tenant's row has this dimension
Dimension = Literal["tenant", "key", "model", "models"]
_REPORTED: tuple[Granularity, ...] = ("minute", "day")

# the time to first token (first_token_ms - entered_ms) in buckets doubling
# from 10 ms: [0, 10), [10, 20), ... [327680, 655360), [655360, ...), and
# one for the requests with no first token
TTFT_BOUNDS_MS: tuple[int, ...] = tuple(10 * 2 ** i for i in range(17))
TTFT_NONE = len(TTFT_BOUNDS_MS) + 1
TTFT_BUCKETS = TTFT_NONE + 1


def ttft_bucket(ttft_ms: int | None) -> int:
    """The histogram bucket of a time to first token (None: no token came)."""
    if ttft_ms is None:
        return TTFT_NONE
    return sum(1 for bound in TTFT_BOUNDS_MS if bound <= ttft_ms)


def ttft_histogram(record: Any) -> tuple[int, ...]:
    """One UsageRecord's histogram: a one in the bucket of its time to first
    token (a first token stamped before the request entered counts as 0)."""
    first = record.get("first_token_ms")
    ttft = None if first is None else max(0, int(first) - int(record["entered_ms"]))
    counts = [0] * TTFT_BUCKETS
    counts[ttft_bucket(ttft)] = 1
    return tuple(counts)


def ttft_percentile(histogram: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of the times a histogram holds, its
    requests with no first token left out; None when none had one. Within a
    bucket the estimate is interpolated (geometrically past the first one);
    in the open last bucket it is the bucket's lower bound."""
    if not 0 < q <= 1:
        raise ValueError(f"a quantile is in (0, 1], not {q}")
    if len(histogram) != TTFT_BUCKETS:
        raise ValueError(f"a TTFT histogram has {TTFT_BUCKETS} buckets, not {len(histogram)}")
    timed = histogram[:TTFT_NONE]
    total = sum(timed)
    if total == 0:
        return None
    rank = q * total
    below = 0
    for index, count in enumerate(timed):
        if count and below + count >= rank:
            share = (rank - below) / count
            if index == 0:
                return TTFT_BOUNDS_MS[0] * share
            if index == len(TTFT_BOUNDS_MS):
                return float(TTFT_BOUNDS_MS[-1])
            low, high = TTFT_BOUNDS_MS[index - 1], TTFT_BOUNDS_MS[index]
            return float(low * (high / low) ** share)
        below += count
    return float(TTFT_BOUNDS_MS[-1])  # not reached: the ranks add up to total


@dataclass(frozen=True)
class RowKey:
    by: Granularity
    dim: Dimension
    bucket_ms: int
    tenant: str
    ident: str = ""  # the key id or the model; "" for the tenant's own row
    partition: int | None = None  # a "models" row's usage partition

    def text(self) -> str:
        fields: list[Any] = [self.by, self.dim, self.bucket_ms, self.tenant, self.ident]
        if self.partition is not None:
            fields.append(self.partition)
        return json.dumps(fields, separators=(",", ":"))

    @property
    def model_wide(self) -> bool:
        """A model's minute over every tenant (one usage partition's share): the
        row that holds a TTFT histogram, kept apart from the tenants' rows."""
        return self.dim == "models"

    @classmethod
    def parse(cls, text: str) -> RowKey:
        by, dim, bucket_ms, tenant, ident, *rest = json.loads(text)
        return cls(by=by, dim=dim, bucket_ms=int(bucket_ms), tenant=tenant, ident=ident,
                   partition=int(rest[0]) if rest else None)


@dataclass(frozen=True)
class Counts:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # a "models" row's TTFT histogram (TTFT_BUCKETS counts); () in the others
    ttft: tuple[int, ...] = ()

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, other: Counts) -> Counts:
        if self.ttft and other.ttft:
            ttft = tuple(a + b for a, b in zip(self.ttft, other.ttft, strict=True))
        else:
            ttft = self.ttft or other.ttft
        return Counts(self.requests + other.requests, self.errors + other.errors,
                      self.prompt_tokens + other.prompt_tokens,
                      self.completion_tokens + other.completion_tokens, ttft)

    def with_ttft_of(self, record: Any) -> Counts:
        """These counts with ``record``'s TTFT histogram (a "models" row's)."""
        return replace(self, ttft=ttft_histogram(record))

    def value(self, partition: int, offset: int) -> dict[str, Any]:
        """The table value: the counts and the position of the last event in them."""
        value: dict[str, Any] = {"r": self.requests, "e": self.errors, "pt": self.prompt_tokens,
                                 "ct": self.completion_tokens, "p": partition, "o": offset}
        if self.ttft:
            value["h"] = list(self.ttft)
        return value

    @classmethod
    def from_value(cls, value: Any) -> Counts:
        return cls(int(value["r"]), int(value["e"]), int(value["pt"]), int(value["ct"]),
                   tuple(int(n) for n in value.get("h", ())))

    @classmethod
    def of(cls, record: Any) -> Counts:
        """What one UsageRecord adds to each of its rows."""
        return cls(requests=1, errors=1 if record["status"] == "error" else 0,
                   prompt_tokens=max(0, int(record["prompt_tokens"])),
                   completion_tokens=max(0, int(record["completion_tokens"])))


def rows_of(record: Any, partition: int) -> list[RowKey]:
    """Every row one UsageRecord, read from ``partition``, counts in: three
    dimensions by minute and by day, the tenant's month, and its model's
    minute over every tenant (that partition's share of it)."""
    at = int(record["finished_ms"])
    tenant = record["tenant"]
    keys: list[RowKey] = []
    for by in _REPORTED:
        start = bucket_start(at, by)
        keys.append(RowKey(by, "tenant", start, tenant))
        keys.append(RowKey(by, "key", start, tenant, record["key_id"]))
        keys.append(RowKey(by, "model", start, tenant, record["model"]))
    keys.append(RowKey("month", "tenant", bucket_start(at, "month"), tenant))
    keys.append(RowKey("minute", "models", bucket_start(at, "minute"), "", record["model"],
                       partition))
    return keys
