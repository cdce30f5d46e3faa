"""The ledger's copy in Redis: its key layout (:class:`UsageKeys`), and the
writer of the accounting tables' rows, each whole (:class:`RedisMirror`).
Read by :class:`~workers.usage.ledger.UsageLedger` and, for the quota keys,
by the rate limiter; the layout and when rows are written:
docs/decisions/0002-faust-on-the-cold-path-only.md."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Any

from conveyor.redis_clients import Redis, text
from workers.usage.ratings import RatingCounts, RatingKey
from workers.usage.rows import Counts, Granularity, RowKey, day_label, expires_at, month_label

__all__ = ["UsageKeys", "encode_counts", "decode_counts", "encode_ratings", "decode_ratings",
           "RedisMirror"]


@dataclass(frozen=True)
class UsageKeys:
    prefix: str

    def quota(self, tenant: str, period: Granularity, at_ms: int) -> str:
        """The quota total of the day or month that holds ``at_ms``."""
        if period == "day":
            return f"{self.prefix}:usage:{tenant}:day:{day_label(at_ms)}"
        if period == "month":
            return f"{self.prefix}:usage:{tenant}:month:{month_label(at_ms)}"
        raise ValueError(f"no quota total by {period}")

    def bucket(self, tenant: str, by: Granularity, bucket_ms: int) -> str:
        """The hash of one minute or day of a tenant."""
        return f"{self.prefix}:usage:{tenant}:by-{by}:{bucket_ms}"

    @staticmethod
    def field(dim: str, ident: str = "") -> str:
        return "tenant" if dim == "tenant" else f"{dim}:{ident}"

    def models(self, bucket_ms: int) -> str:
        """The hash of one minute of every model over all tenants: a field
        ``<usage partition>:<model>`` a partition's share (no tenant's key
        starts ``<prefix>:usage-models:``)."""
        return f"{self.prefix}:usage-models:by-minute:{bucket_ms}"

    @staticmethod
    def model_field(partition: int, model: str) -> str:
        return f"{partition}:{model}"

    @staticmethod
    def parse_model_field(field: str) -> tuple[int, str]:
        partition, model = field.split(":", 1)
        return int(partition), model

    def ratings(self, tenant: str, day_ms: int) -> str:
        """The hash of one day's ratings of a tenant."""
        return f"{self.prefix}:ratings:{tenant}:by-day:{day_ms}"


def encode_counts(counts: Counts) -> str:
    """``"<requests> <errors> <prompt tokens> <completion tokens>"``, then a
    "models" row's TTFT histogram, a count a bucket."""
    head = (f"{counts.requests} {counts.errors} {counts.prompt_tokens} "
            f"{counts.completion_tokens}")
    return " ".join([head, *map(str, counts.ttft)]) if counts.ttft else head


def encode_ratings(counts: RatingCounts) -> str:
    return f"{counts.count} {counts.score_sum}"


def decode_ratings(value: str | bytes) -> RatingCounts:
    count, score_sum = text(value).split()
    return RatingCounts(int(count), float(score_sum))


def decode_counts(value: str | bytes) -> Counts:
    requests, errors, prompt, completion, *ttft = (int(v) for v in text(value).split())
    return Counts(requests, errors, prompt, completion, tuple(ttft))


class RedisMirror:
    def __init__(self, redis: Redis, keys: UsageKeys, batch: int = 1000) -> None:
        self.redis = redis
        self.keys = keys
        self.batch = batch

    async def write(self, rows: Iterable[tuple[RowKey, Counts]],
                    ratings: Iterable[tuple[RatingKey, RatingCounts]] = ()) -> int:
        """Write the usage ``rows`` and the rating rows (workers/usage/ratings.py)
        to Redis; returns how many. Raises redis's errors (the caller keeps
        the rows to write them again)."""
        written = 0
        expiring: set[str] = set()  # the hashes given their expiry in this pipeline
        pipe = self.redis.pipeline(transaction=False)
        for queue in chain((partial(self._queue, key, counts, expiring) for key, counts in rows),
                           (partial(self._queue_rating, key, counts) for key, counts in ratings)):
            queue(pipe)
            written += 1
            if len(pipe) >= self.batch:
                await pipe.execute()
                pipe = self.redis.pipeline(transaction=False)
                expiring.clear()
        if len(pipe):
            await pipe.execute()
        return written

    def _queue_rating(self, key: RatingKey, counts: RatingCounts, pipe: Any) -> None:
        name = self.keys.ratings(key.tenant, key.day_ms)
        pipe.hset(name, UsageKeys.field(key.dim, key.ident), encode_ratings(counts))
        pipe.pexpireat(name, key.expires_ms)

    def _queue(self, key: RowKey, counts: Counts, expiring: set[str], pipe: Any) -> None:
        until = expires_at(key.bucket_ms, key.by)
        if key.by == "month":
            pipe.set(self.keys.quota(key.tenant, "month", key.bucket_ms),
                     counts.total_tokens, pxat=until)
            return
        if key.model_wide:
            name = self.keys.models(key.bucket_ms)
            field = self.keys.model_field(key.partition or 0, key.ident)
        else:
            name = self.keys.bucket(key.tenant, key.by, key.bucket_ms)
            field = self.keys.field(key.dim, key.ident)
        pipe.hset(name, field, encode_counts(counts))
        if name not in expiring:
            pipe.pexpireat(name, until)
            expiring.add(name)
        if key.by == "day" and key.dim == "tenant":
            pipe.set(self.keys.quota(key.tenant, "day", key.bucket_ms),
                     counts.total_tokens, pxat=until)
