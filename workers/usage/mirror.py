"""The ledger's copy in Redis: its key layout, and the mirror tick that
writes every row of the accounting tables whole. Read by
:class:`~workers.usage.ledger.UsageLedger` and, for the two quota keys, by
the rate limiter's admission script.

``P`` is ``settings.kafka.topic_prefix``; days and months are UTC; ``B`` is a
bucket start in epoch milliseconds.

- ``P:usage:<tenant>:day:<YYYY-MM-DD>``: STRING, the tenant's prompt plus
  completion tokens of that day (an integer). Read by the quota check.
- ``P:usage:<tenant>:month:<YYYY-MM>``: STRING, the same for the month.
- ``P:usage:<tenant>:by-minute:<B>`` and ``P:usage:<tenant>:by-day:<B>``:
  HASH, one field per row of that bucket: ``tenant`` (the tenant's own
  total), ``key:<key id>`` and ``model:<model>``; each value is
  ``"<requests> <errors> <prompt tokens> <completion tokens>"``.

- ``P:ratings:<tenant>:by-day:<B>``: HASH, the ratings of that day
  (workers/usage/ratings.py): ``tenant``, ``model:<model asked for>`` and
  ``deployment:<model that answered>``; each value is ``"<count> <score sum>"``.

Every key is written whole with SET/HSET (never INCR), in pipelines without
a transaction: writing it again is harmless, a stale write is put right by
the next pass. Every key expires with its bucket (``PXAT``/``PEXPIREAT``).
Every ``MIRROR_INTERVAL_S`` (workers/usage/app.py) the rows changed since the
last tick are written; every ``FULL_MIRROR_EVERY`` ticks, and after a failed
write, every row the member owns, so Redis heals from a FLUSHALL within
seconds. Nothing while a rebalance or a table recovery is under way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.redis_clients import REDIS_ERRORS, Redis
from topics.backoff import RateLimitedLog
from workers.usage.counting import Counter
from workers.usage.ratings import RatingCounts, RatingKey, Ratings
from workers.usage.rows import Counts, Granularity, RowKey, day_label, expires_at, month_label

__all__ = ["UsageKeys", "encode_counts", "decode_counts", "encode_ratings", "decode_ratings",
           "RedisMirror", "MirrorPass", "MirrorSource", "FULL_MIRROR_EVERY", "UNREADY_WARN_S"]

log = logging.getLogger(__name__)


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

    def ratings(self, tenant: str, day_ms: int) -> str:
        """The hash of one day's ratings of a tenant."""
        return f"{self.prefix}:ratings:{tenant}:by-day:{day_ms}"


def encode_counts(counts: Counts) -> str:
    return (f"{counts.requests} {counts.errors} {counts.prompt_tokens} "
            f"{counts.completion_tokens}")


def encode_ratings(counts: RatingCounts) -> str:
    return f"{counts.count} {counts.score_sum}"


def decode_ratings(text: str | bytes) -> RatingCounts:
    raw = text.decode() if isinstance(text, bytes) else text
    count, score_sum = raw.split()
    return RatingCounts(int(count), float(score_sum))


def decode_counts(text: str | bytes) -> Counts:
    raw = text.decode() if isinstance(text, bytes) else text
    requests, errors, prompt, completion = (int(v) for v in raw.split())
    return Counts(requests, errors, prompt, completion)


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


FULL_MIRROR_EVERY = 10  # ticks: a full pass every 5 s
UNREADY_WARN_S = 15.0  # the mirror says so when the tables stay unready this long


class MirrorSource(Protocol):
    """What a tick reads of the accounting app that owns it (workers/usage/app.py)."""

    app: Any  # the Faust app: rebalancing, recovery, the partitions it holds
    source_topic: str
    feedback_topic: str
    totals: Any  # the usage-totals table
    rating_table: Any  # the feedback-ratings table
    counter: Counter
    ratings: Ratings
    mirror: RedisMirror


class MirrorPass:
    """The tick of one accounting app (:class:`MirrorSource`)."""

    def __init__(self, owner: MirrorSource) -> None:
        self.owner = owner
        self._ticks = 0
        self._full_due = True
        self._problems = RateLimitedLog(log)
        self._unready_since: float | None = None

    def ready(self) -> bool:
        """Whether the tables are whole: no rebalance or recovery under way."""
        # Faust's own flags (faust-streaming 0.15.3: App.rebalancing, App.in_recovery,
        # Recovery.completed), read only; tests/unit/workers/usage/test_faust_patches.py
        app = self.owner.app
        recovery: Any = getattr(app.tables, "recovery", None)
        return (not app.rebalancing and not app.in_recovery
                and recovery is not None and recovery.completed.is_set())

    def active_partitions(self) -> set[int]:
        return {tp.partition for tp in self.owner.app.assignor.assigned_actives()
                if tp.topic == self.owner.source_topic}

    def rows(self, texts: Iterable[str] | None, partitions: set[int]
             ) -> Iterator[tuple[RowKey, Counts]]:
        """The rows of ``texts`` (all when None) that this member owns."""
        if texts is None:
            items: Iterable[tuple[str, Any]] = list(self.owner.totals.items())
        else:
            items = [(t, self.owner.totals.get(t)) for t in texts]
        for text, value in items:
            if value is not None and value["p"] in partitions:
                yield RowKey.parse(text), Counts.from_value(value)

    def rating_rows(self, texts: Iterable[str] | None
                    ) -> Iterator[tuple[RatingKey, RatingCounts]]:
        """The rating rows of ``texts`` (all when None), when this member owns
        the feedback topic's partition."""
        owned = any(tp.topic == self.owner.feedback_topic
                    for tp in self.owner.app.assignor.assigned_actives())
        if not owned:
            return
        if texts is None:
            items: Iterable[tuple[str, Any]] = list(self.owner.ratings.rows())
        else:
            items = [(t, self.owner.rating_table.get(t)) for t in texts]
        for text, value in items:
            if value is not None:
                yield RatingKey.parse(text), RatingCounts.from_value(value)

    async def mirror_once(self) -> int:
        """One tick: write the changed rows, or all of them when a full pass is due."""
        if not self.ready():
            if self._unready_since is None:
                self._unready_since = time.monotonic()
            elif time.monotonic() - self._unready_since >= UNREADY_WARN_S:
                recovery: Any = getattr(self.owner.app.tables, "recovery", None)
                self._problems.warning(
                    "unready", "usage mirror: the tables have not been whole for %.0f s "
                    "(rebalancing %s, in recovery %s, recovery complete %s); nothing mirrored",
                    time.monotonic() - self._unready_since, self.owner.app.rebalancing,
                    self.owner.app.in_recovery,
                    recovery is not None and recovery.completed.is_set())
            return 0
        if self._unready_since is not None:
            self._unready_since = None
            self._problems.resolved("unready", "usage mirror: the tables are whole again")
        self._ticks += 1
        full = self._full_due or self._ticks % FULL_MIRROR_EVERY == 0
        dirty = self.owner.counter.take_dirty()
        rated = self.owner.ratings.take_dirty()
        # read every value now (no await in between): what is written is one moment
        rows = list(self.rows(None if full else dirty, self.active_partitions()))
        ratings = list(self.rating_rows(None if full else rated))
        try:
            written = await self.owner.mirror.write(rows)
            written += await self.owner.mirror.write_ratings(ratings)
        except REDIS_ERRORS as exc:
            self.owner.counter.dirty |= dirty
            self.owner.ratings.dirty |= rated
            self._full_due = True
            self._problems.warning("mirror", "usage mirror: Redis failed (%r); retrying",
                                   exc)
            return 0
        self._full_due = False
        self._problems.resolved("mirror", "usage mirror: Redis answers again")
        return written
