"""The accounting app's mirror tick: which rows it writes to Redis, and when.

Every ``MIRROR_INTERVAL_S`` (workers/usage/app.py) the rows changed since the
last tick; every ``FULL_MIRROR_EVERY`` ticks, and after a failed write, every
row of the partitions the member owns, so Redis heals from a FLUSHALL within
seconds. Nothing while a rebalance or a table recovery is under way (a
half-restored table would write totals too low; said in the log after
``UNREADY_WARN_S``). A failing Redis is logged and the rows kept for the next tick.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from conveyor.redis_clients import REDIS_ERRORS
from topics.backoff import RateLimitedLog
from workers.usage.counting import Counter
from workers.usage.mirror import RedisMirror
from workers.usage.ratings import RatingCounts, RatingKey, Ratings
from workers.usage.rows import Counts, RowKey

__all__ = ["MirrorPass", "MirrorSource", "FULL_MIRROR_EVERY", "UNREADY_WARN_S"]

log = logging.getLogger(__name__)

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
