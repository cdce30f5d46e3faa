"""The background and batch tasks schedule holds back until a worker has room
(:class:`HeldQueue`: per pool, by priority then arrival, kept encoded, each
until its own deadline), and when one may go beside interactive traffic
(:class:`BatchAdmission`; docs/decisions/0005-schedule-holds-the-queue.md)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from schemas.codec import Codec
from schemas.records import Task
from topics.catalog import ROUTED
from topics.envelope import now_ms

__all__ = ["Held", "HeldQueue", "BatchAdmission", "Candidate"]


@dataclass(eq=False, slots=True)
class Held:
    """One task held back: what it takes to release it, fail it or commit past it."""

    request_id: str
    pool: str
    priority: int
    give_up_ms: int
    tp: TopicPartition | None
    offset: int
    # the encoded Task as read (decoded again on release), or the Task itself
    # when there are no bytes (an event not read from Kafka)
    payload: bytes | Task
    # when schedule took the task (its envelope's ``schedule`` stamp)
    stamped_us: int
    # the model it asks for (a worker may serve only some of its pool's)
    model: str = ""
    seq: int = 0
    gone: bool = field(default=False)

    def task(self, codec: Codec, layer: str) -> Task:
        """The task, decoded again from the bytes read (stamped by ``layer`` then)."""
        if not isinstance(self.payload, bytes):
            return self.payload
        task = ROUTED.decode(codec, self.payload)
        task["envelope"]["stamps"].setdefault(layer, self.stamped_us)
        return task


class HeldQueue:
    """Held tasks by pool (in release order), by request id, by deadline and by
    source partition."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._by_id: dict[str, Held] = {}
        self._by_pool: dict[str, list[tuple[int, int, Held]]] = {}
        self._pool_count: dict[str, int] = {}
        self._by_deadline: list[tuple[int, int, Held]] = []
        self._offsets: dict[TopicPartition, list[int]] = {}
        self._live: dict[TopicPartition, dict[int, Held]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def count(self, pool: str) -> int:
        return self._pool_count.get(pool, 0)

    def pools(self) -> list[str]:
        """The pools with tasks held."""
        return [pool for pool, n in self._pool_count.items() if n > 0]

    def add(self, held: Held) -> bool:
        """Hold ``held``; False for a request already held (a redelivery: the
        first one, with the lower offset, stays)."""
        if held.request_id in self._by_id:
            return False
        held.seq = next(self._seq)
        self._by_id[held.request_id] = held
        heapq.heappush(self._by_pool.setdefault(held.pool, []),
                       (held.priority, held.seq, held))
        self._pool_count[held.pool] = self._pool_count.get(held.pool, 0) + 1
        heapq.heappush(self._by_deadline, (held.give_up_ms, held.seq, held))
        if held.tp is not None:
            heapq.heappush(self._offsets.setdefault(held.tp, []), held.offset)
            self._live.setdefault(held.tp, {})[held.offset] = held
        return True

    def peek(self, pool: str) -> Held | None:
        """The next task of ``pool`` to release, if any."""
        heap = self._by_pool.get(pool)
        while heap and heap[0][2].gone:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self, pool: str) -> Held | None:
        """Take the next task of ``pool`` out (to release it)."""
        held = self.peek(pool)
        if held is not None:
            self._drop(held)
        return held

    def remove(self, request_id: str) -> Held | None:
        """Take a request's task out (a cancel)."""
        held = self._by_id.get(request_id)
        if held is not None:
            self._drop(held)
        return held

    def expired(self, now_ms: int) -> list[Held]:
        """Take out (and return) every task whose time is up."""
        out: list[Held] = []
        heap = self._by_deadline
        while heap and (heap[0][2].gone or heap[0][0] <= now_ms):
            _, _, held = heapq.heappop(heap)
            if not held.gone:
                self._drop(held)
                out.append(held)
        return out

    def low(self, tp: TopicPartition) -> int | None:
        """The lowest offset of ``tp`` still held (nothing at or past it may be
        committed), or None."""
        heap = self._offsets.get(tp)
        live = self._live.get(tp, {})
        while heap and heap[0] not in live:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def revoked(self, partitions: Iterable[TopicPartition]) -> None:
        """Forget the tasks read from ``partitions``: their new owner holds them."""
        for tp in partitions:
            for held in list(self._live.get(tp, {}).values()):
                self._drop(held)
            self._offsets.pop(tp, None)
            self._live.pop(tp, None)

    def _drop(self, held: Held) -> None:
        if held.gone:
            return
        held.gone = True
        self._by_id.pop(held.request_id, None)
        self._pool_count[held.pool] -= 1
        if held.tp is not None:
            live = self._live.get(held.tp)
            if live is not None and live.get(held.offset) is held:
                del live[held.offset]
        # the heaps drop it lazily; keep them from growing without bound when
        # most of their entries are gone (cancels of a whole batch)
        heap = self._by_pool.get(held.pool)
        if heap is not None and len(heap) > 64 and len(heap) > 4 * self._pool_count[held.pool]:
            self._by_pool[held.pool] = [e for e in heap if not e[2].gone]
            heapq.heapify(self._by_pool[held.pool])
        if len(self._by_deadline) > 64 and len(self._by_deadline) > 4 * len(self._by_id):
            self._by_deadline = [e for e in self._by_deadline if not e[2].gone]
            heapq.heapify(self._by_deadline)


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
