"""The ledger's copy in Redis: every row of the accounting tables written whole.

Readers (the CLI, the admin endpoint, the quota check) read Redis, never
Faust. The accounting app calls :meth:`RedisMirror.write` with the rows that
changed about twice a second, and with every row it owns every few seconds
(see workers/usage/app.py): SET and HSET of absolute values, never INCR, so
writing a row twice is harmless, a row written from a stale read is put
right by the next pass, and a Redis that lost its data (FLUSHALL, a restart
without its file) is whole again after one full pass, with no new traffic.

Commands go in pipelines of ``batch`` (no transaction: each write stands on
its own). A full pass of 20,000 rows is 20 round trips of 1,000 commands,
tens of milliseconds on loopback.
"""

from __future__ import annotations

from collections.abc import Iterable
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
        written = 0
        pipe = self.redis.pipeline(transaction=False)
        expiring: set[str] = set()
        for key, counts in rows:
            self._queue(pipe, key, counts, expiring)
            written += 1
            if len(pipe) >= self.batch:
                await pipe.execute()
                pipe = self.redis.pipeline(transaction=False)
                expiring.clear()
        if len(pipe):
            await pipe.execute()
        return written

    async def write_ratings(self, rows: Iterable[tuple[RatingKey, RatingCounts]]) -> int:
        """Write the rating rows (workers/usage/ratings.py); how many."""
        written = 0
        pipe = self.redis.pipeline(transaction=False)
        for key, counts in rows:
            name = self.keys.ratings(key.tenant, key.day_ms)
            field = "tenant" if key.dim == "tenant" else f"{key.dim}:{key.ident}"
            pipe.hset(name, field, encode_ratings(counts))
            pipe.pexpireat(name, key.expires_ms)
            written += 1
            if len(pipe) >= self.batch:
                await pipe.execute()
                pipe = self.redis.pipeline(transaction=False)
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
