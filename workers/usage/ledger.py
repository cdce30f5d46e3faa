"""Reading the usage ledger from Redis (workers/usage/mirror.py): reports
(a row per bucket that saw requests in ``[since_ms, until_ms)``, oldest
first, cut to the buckets' retention) and ratings."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from typing import Any, Literal

from conveyor.errors import InvalidRequest
from conveyor.redis_clients import Redis, text
from conveyor.settings import Settings
from topics.envelope import now_ms
from workers.usage.mirror import UsageKeys, decode_counts, decode_ratings
from workers.usage.rows import (
    DAY_MS,
    RETENTION_MS,
    Counts,
    bucket_start,
    next_bucket,
    ttft_percentile,
)

__all__ = ["UsageLedger", "UsageRow", "RatingsDay", "ReportBy", "ModelMinute"]

ReportBy = Literal["minute", "day"]


@dataclass(frozen=True)
class _Bucket:
    bucket_start_ms: int

    def as_dict(self) -> dict[str, Any]:
        """For JSON: the fields, and the bucket start as UTC ISO 8601 too."""
        start = dt.datetime.fromtimestamp(self.bucket_start_ms / 1000, tz=dt.UTC)
        return {"bucket_start": start.isoformat().replace("+00:00", "Z"), **asdict(self)}


@dataclass(frozen=True)
class UsageRow(_Bucket):
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class RatingsDay(_Bucket):
    count: int
    mean: float | None
    by_model: dict[str, dict[str, Any]]
    by_deployment: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class ModelMinute:
    """One minute of one model over every tenant."""

    bucket_start_ms: int
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    ttft_p50_ms: float | None  # None when no request of the minute had a first token
    ttft_p99_ms: float | None


def _model_minute(start: int, counts: Counts) -> ModelMinute:
    p50 = p99 = None
    if counts.ttft:
        p50, p99 = ttft_percentile(counts.ttft, 0.5), ttft_percentile(counts.ttft, 0.99)
    return ModelMinute(start, counts.requests, counts.errors, counts.prompt_tokens,
                       counts.completion_tokens, p50, p99)


def _bucket_starts(since_ms: int, until_ms: int, by: ReportBy) -> list[int]:
    """The starts of the buckets of ``by`` that overlap ``[since_ms, until_ms)``
    and may still exist (see the module)."""
    if until_ms <= since_ms:
        return []
    now = now_ms()
    start = bucket_start(max(since_ms, now - RETENTION_MS[by]), by)
    end = min(until_ms, now + DAY_MS)
    starts: list[int] = []
    while start < end:
        starts.append(start)
        start = next_bucket(start, by)
    return starts


def _ratings_day(start: int, fields: dict[Any, Any], model: str | None) -> RatingsDay | None:
    decoded = {text(k): decode_ratings(v)
               for k, v in fields.items()}
    by_model = {name.removeprefix("model:"): {"count": c.count, "mean": c.mean}
                for name, c in decoded.items() if name.startswith("model:") and c.count}
    by_deployment = {name.removeprefix("deployment:"): {"count": c.count, "mean": c.mean}
                     for name, c in decoded.items()
                     if name.startswith("deployment:") and c.count}
    if model is not None:
        own = decoded.get(f"model:{model}")
        if own is None or not own.count:
            return None
        return RatingsDay(start, own.count, own.mean, {model: by_model[model]}, {})
    total = decoded.get("tenant")
    if total is None or not total.count:
        return None
    return RatingsDay(start, total.count, total.mean, by_model, by_deployment)


class UsageLedger:
    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = UsageKeys(settings.kafka.topic_prefix)

    async def report(self, tenant: str, *, since_ms: int, until_ms: int,
                     by: ReportBy = "day", key_id: str | None = None,
                     model: str | None = None) -> list[UsageRow]:
        """The tenant's usage by ``by``: its own totals, or those of one of its
        API keys (``key_id``) or of one model (``model``)."""
        if by not in ("minute", "day"):
            raise InvalidRequest(f"usage is reported by minute or by day, not {by!r}",
                                 param="by")
        if key_id is not None and model is not None:
            raise InvalidRequest("usage is kept per key and per model, not per key and "
                                 "model together: give one of them", param="model")
        if key_id is not None:
            field = self.keys.field("key", key_id)
        elif model is not None:
            field = self.keys.field("model", model)
        else:
            field = self.keys.field("tenant")
        starts = _bucket_starts(since_ms, until_ms, by)
        if not starts:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for b in starts:
            pipe.hget(self.keys.bucket(tenant, by, b), field)
        values: list[Any] = await pipe.execute()
        rows: list[UsageRow] = []
        for b, value in zip(starts, values, strict=True):
            if value is not None:
                counts = decode_counts(value)  # a UsageRow is its counts and their total
                rows.append(UsageRow(b, counts.requests, counts.errors, counts.prompt_tokens,
                                     counts.completion_tokens, counts.total_tokens))
        return rows

    async def ratings(self, tenant: str, *, since_ms: int, until_ms: int,
                      model: str | None = None) -> list[RatingsDay]:
        """The tenant's ratings by day (workers/usage/ratings.py): each day that
        has some, with the count and mean score in all, per model asked for and
        per deployment that answered (with ``model``: that model's alone)."""
        starts = _bucket_starts(since_ms, until_ms, "day")
        if not starts:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for b in starts:
            pipe.hgetall(self.keys.ratings(tenant, b))
        days: list[RatingsDay] = []
        for b, fields in zip(starts, await pipe.execute(), strict=True):
            day = _ratings_day(b, fields, model)
            if day is not None:
                days.append(day)
        return days

    async def model_minutes(self, *, since_ms: int, until_ms: int
                            ) -> dict[str, list[ModelMinute]]:
        """Every model with requests in [since_ms, until_ms), its minutes that
        saw requests, oldest first (every tenant's requests: the shares of the
        usage partitions added up)."""
        starts = _bucket_starts(since_ms, until_ms, "minute")
        if not starts:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for b in starts:
            pipe.hgetall(self.keys.models(b))
        models: dict[str, list[ModelMinute]] = {}
        for b, fields in zip(starts, await pipe.execute(), strict=True):
            summed: dict[str, Counts] = {}
            for name, value in fields.items():
                _, model = self.keys.parse_model_field(text(name))
                summed[model] = summed.get(model, Counts()).plus(decode_counts(value))
            for model, counts in sorted(summed.items()):
                if counts.requests:
                    models.setdefault(model, []).append(_model_minute(b, counts))
        return models
