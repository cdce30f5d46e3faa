"""Whether the accounting app still counts what it holds, and if not, why.

A member holding a usage or feedback partition with events past the last one
it handled, none handled for :data:`STALL_AFTER_S`, says so in the log
(rate-limited) with Faust's consumer state of that partition (the flows,
fetched or paused, offsets read and committed, high-water mark, generation,
rebalancing). :func:`consumer_state` reads Faust's internals (faust-streaming
0.15.3, read only, pinned by tests/unit/workers/usage/test_faust_patches.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STALL_AFTER_S", "Progress", "Stall", "committed", "consumer_state", "highwater"]

STALL_AFTER_S = 20.0


@dataclass(frozen=True)
class Stall:
    topic: str
    partition: int
    handled: int | None  # the last offset handled, None when none yet
    highwater: int
    idle_s: float


@dataclass
class Progress:
    """The last offset handled of each partition and when it changed."""

    clock: Callable[[], float] = time.monotonic
    stall_after_s: float = STALL_AFTER_S
    _last: dict[tuple[str, int], tuple[int | None, float]] = field(default_factory=dict)

    def handled(self, topic: str, partition: int, offset: int) -> None:
        self._last[(topic, partition)] = (offset, self.clock())

    def stalls(self, held: Iterable[tuple[str, int, int | None, int | None]]
               ) -> list[Stall]:
        """The partitions of ``held`` (topic, partition, high-water mark and
        committed offset, each None when unknown) with events past the last
        handled and the commit, and none handled for ``stall_after_s``; a
        partition seen here for the first time starts its wait now."""
        now = self.clock()
        found = []
        for topic, partition, highwater, committed in held:
            key = (topic, partition)
            if key not in self._last:
                self._last[key] = (None, now)
            offset, since = self._last[key]
            done = max(0 if offset is None else offset + 1, committed or 0)
            if highwater is None or highwater <= done:
                self._last[key] = (offset, now)  # nothing waiting: not idle
                continue
            if now - since >= self.stall_after_s:
                found.append(Stall(topic, partition, offset, highwater, now - since))
        return found


def highwater(app: Any, tp: Any) -> int | None:
    """The broker's high-water mark of ``tp`` as the consumer last fetched it."""
    try:
        return int(app.consumer.highwater(tp))
    except Exception:  # not assigned (any more), or not fetched yet
        return None


def committed(app: Any, tp: Any) -> int | None:
    """The offset Faust last committed (or sought to) on ``tp``."""
    offset = app.consumer._committed_offset.get(tp)
    return None if offset is None else int(offset)


def consumer_state(app: Any, tp: Any) -> str:
    """Faust's consumer state for ``tp``, for a log line."""
    consumer = app.consumer
    return (f"flow {'on' if consumer.flow_active else 'off'}, agents' flow "
            f"{'on' if app.flow_control.is_active() else 'off'}, "
            f"{'paused' if tp in consumer._paused_partitions else 'fetched'}, "
            f"read {consumer._read_offset.get(tp)}, committed "
            f"{consumer._committed_offset.get(tp)}, generation "
            f"{app.consumer_generation_id}, rebalancing {app.rebalancing}")
