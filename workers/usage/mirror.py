"""The ledger's copy in Redis: every row of the accounting tables written whole.

Readers (the CLI, the admin endpoint, the quota check) read Redis, never
Faust. SET and HSET of absolute values, never INCR: writing a row twice is
harmless, a stale write is put right by the next pass, and a Redis that lost
its data is whole after one full pass (workers/usage/mirroring.py says
when). Commands go in pipelines of ``batch``, without a transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from conveyor.redis_clients import Redis
from workers.usage.buckets import expires_at
from workers.usage.layout import UsageKeys, encode_counts, encode_ratings
from workers.usage.ratings import RatingCounts, RatingKey
from workers.usage.rows import Counts, RowKey

__all__ = ["RedisMirror"]


class RedisMirror:
    def __init__(self, redis: Redis, keys: UsageKeys, batch: int = 1000) -> None:
        self.redis = redis
        self.keys = keys
        self.batch = batch

    async def write(self, rows: Iterable[tuple[RowKey, Counts]]) -> int:
        """Write ``rows`` to Redis; returns how many. Raises redis's errors
        (the caller keeps the rows to write them again)."""
        expiring: set[str] = set()
        return await self._pipelined(
            lambda pipe, key, counts: self._queue(pipe, key, counts, expiring),
            rows, expiring.clear)

    async def write_ratings(self, rows: Iterable[tuple[RatingKey, RatingCounts]]) -> int:
        """Write the rating rows (workers/usage/ratings.py); how many."""

        def queue(pipe: Any, key: RatingKey, counts: RatingCounts) -> None:
            name = self.keys.ratings(key.tenant, key.day_ms)
            pipe.hset(name, UsageKeys.field(key.dim, key.ident), encode_ratings(counts))
            pipe.pexpireat(name, key.expires_ms)

        return await self._pipelined(queue, rows)

    async def _pipelined(self, queue: Callable[[Any, Any, Any], None],
                         rows: Iterable[tuple[Any, Any]],
                         on_execute: Callable[[], None] = lambda: None) -> int:
        written = 0
        pipe = self.redis.pipeline(transaction=False)
        for key, counts in rows:
            queue(pipe, key, counts)
            written += 1
            if len(pipe) >= self.batch:
                await pipe.execute()
                pipe = self.redis.pipeline(transaction=False)
                on_execute()
        if len(pipe):
            await pipe.execute()
        return written

    def _queue(self, pipe: Any, key: RowKey, counts: Counts, expiring: set[str]) -> None:
        until = expires_at(key.bucket_ms, key.by)
        if key.by == "month":
            pipe.set(self.keys.quota(key.tenant, "month", key.bucket_ms),
                     counts.total_tokens, pxat=until)
            return
        name = self.keys.bucket(key.tenant, key.by, key.bucket_ms)
        pipe.hset(name, self.keys.field(key.dim, key.ident), encode_counts(counts))
        if name not in expiring:
            pipe.pexpireat(name, until)
            expiring.add(name)
        if key.by == "day" and key.dim == "tenant":
            pipe.set(self.keys.quota(key.tenant, "day", key.bucket_ms),
                     counts.total_tokens, pxat=until)
