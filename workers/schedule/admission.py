"""When a held background or batch task may go to a worker, and to which
(docs/decisions/0005-schedule-holds-the-queue.md).

* **Interactive traffic is around** on a pool when an interactive task
  schedule sent has not finished or was sent less than ``linger_s`` ago, or
  the pool's heartbeats say one runs or was taken that recently (``seen``:
  another schedule member's traffic). Then background and batch tasks
  together hold at most ``floor(pool capacity * share)`` slots, and go only
  to a worker with a free slot, so an interactive task never queues behind
  one in a partition.
* **Otherwise** they may fill every slot, plus ``prefetch`` per worker.

With several schedule members each keeps to its part of the share: the share
times the fraction of the source topic's partitions it is assigned
(``fraction``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from topics.envelope import now_ms

__all__ = ["BatchAdmission", "Candidate"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A live worker of the pool: its id, capacity and load as schedule knows it."""

    worker_id: str
    capacity: int
    load: int


@dataclass
class BatchAdmission:
    share: float
    prefetch: int = 0
    linger_s: float = 2.0
    clock: Callable[[], int] = now_ms
    # the part of the source topic's partitions this member is assigned (1: all)
    fraction: float = 1.0
    _last_interactive_ms: dict[str, int] = field(default_factory=dict)

    def interactive_sent(self, pool: str) -> None:
        """An interactive task of ``pool`` went to a worker just now."""
        self._last_interactive_ms[pool] = self.clock()

    def interactive_around(self, pool: str, interactive_outstanding: int,
                           seen: tuple[int, int] = (0, 0)) -> bool:
        """Whether interactive traffic is about on ``pool``: this member's
        (``interactive_outstanding``, its last send) or, from the workers'
        heartbeats, anyone's (``seen``: running, when the last was taken)."""
        running, taken_ms = seen
        if interactive_outstanding > 0 or running > 0:
            return True
        last = max(self._last_interactive_ms.get(pool, 0), taken_ms)
        return last > 0 and self.clock() - last < self.linger_s * 1000

    def cap(self, capacity: int) -> int:
        """The slots background and batch tasks this member sent may hold in a
        pool of ``capacity`` while interactive traffic is around."""
        return math.floor(capacity * self.share * self.fraction + 1e-9)

    def choose(self, pool: str, candidates: list[Candidate], low_outstanding: int,
               interactive_outstanding: int, seen: tuple[int, int] = (0, 0)
               ) -> Candidate | None:
        """The worker the next held task of ``pool`` goes to now, or None (it
        stays held)."""
        if not candidates:
            return None
        prefetch = self.prefetch
        if self.interactive_around(pool, interactive_outstanding, seen):
            if low_outstanding >= self.cap(sum(c.capacity for c in candidates)):
                return None
            prefetch = 0
        room = [c for c in candidates if c.load < c.capacity + prefetch]
        if not room:
            return None
        return min(room, key=lambda c: (c.load / max(1, c.capacity), c.worker_id))
