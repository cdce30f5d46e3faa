"""When a held background or batch task may go to a worker, and to which.

The rule, per pool (capacities from heartbeats, loads as schedule knows
them: the worker's last heartbeat, plus what schedule sent it since, minus
what finished since, and never less than what schedule itself sent and has
not seen finish):

* **Interactive traffic is around** when an interactive task of the pool
  that schedule sent has not finished, or one was sent less than
  ``linger_s`` ago. Then background and batch tasks together may hold at
  most ``floor(pool capacity * share)`` slots of the pool
  (``settings.schedule.batch_max_share``; a pool of capacity 4 keeps one slot free,
  capacity 2 keeps one, capacity 1 keeps its only one), and a task goes only
  to a worker with a free slot: it never waits in a partition, so an
  interactive task never queues behind one, and waits at most for a slot to
  free (it finds one at once while the pool is not full).
* **Otherwise** (work conserving) they may fill every slot, plus
  ``prefetch`` per worker waiting in its partition so that a worker never
  idles between a finish and the next release. The default is 0: the end of
  a generation reaches schedule through ``conveyor.tokens`` in milliseconds
  (:mod:`workers.schedule.finishes`), so the slot stays empty for about one
  produce and one fetch, and an interactive task that arrives into a full
  pool waits for one slot, not for a prefetched batch task too.

The linger keeps the reserve for the next request of a conversation: with
none, a slot freed between two interactive requests 100 ms apart would go to
a batch task, and the second request would wait a whole generation. It
costs a batch at most ``(1 - share)`` of the pool for ``linger_s`` after the
last interactive request. A batch never starves: when interactive load
stops, it has the whole pool ``linger_s`` later. While interactive load goes
on it has its share of what interactive traffic leaves free, and nothing in
a pool of capacity 1.

With several schedule members, each applies to the tasks it sent its part of
the share: the share times the fraction of the source topic's partitions it
is assigned (``fraction``), so that together they keep to the share (batch
lines are keyed by their request ids, so they spread over the partitions
like the members' parts do). Slots are checked against heartbeats, so
together they never fill a worker past its capacity. Whether interactive
traffic is around is the cluster's view: besides what the member sent
itself, the pool's workers say in each heartbeat how many interactive
generations they run and when they last took one (``seen``), so a member
that sent no interactive task still keeps to its share while another
member's interactive traffic goes on (seen within a heartbeat, a second).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from topics.envelope import now_ms

__all__ = ["BatchAdmission", "Candidate"]

# the default linger after the last interactive task
LINGER_S = 2.0


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
    linger_s: float = LINGER_S
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
