"""HeldQueue: release order, cancels, deadlines, offsets, and 50,000 held tasks."""

from __future__ import annotations

import tracemalloc

from aiokafka import TopicPartition

from schemas.codec import default_codec
from tests.support.schedule_tasks import full_task
from workers.schedule.held import Held, HeldQueue

TP0 = TopicPartition("sched.routed", 0)
TP1 = TopicPartition("sched.routed", 1)


def held(rid: str, *, priority: int = 2, pool: str = "cpu", give_up_ms: int = 10_000,
         tp: TopicPartition | None = TP0, offset: int = 0,
         payload: bytes = b"x") -> Held:
    return Held(request_id=rid, pool=pool, priority=priority, give_up_ms=give_up_ms, tp=tp,
                offset=offset, payload=payload, stamped_us=0)


def test_background_goes_before_batch_and_each_in_arrival_order() -> None:
    q = HeldQueue()
    q.add(held("b1", priority=2, offset=1))
    q.add(held("g1", priority=1, offset=2))
    q.add(held("b2", priority=2, offset=3))
    q.add(held("g2", priority=1, offset=4))
    q.add(held("other", pool="gpu", offset=5))
    out = []
    while (h := q.pop("cpu")) is not None:
        out.append(h.request_id)
    assert out == ["g1", "g2", "b1", "b2"]
    assert q.pools() == ["gpu"] and len(q) == 1


def test_a_redelivered_request_is_held_once() -> None:
    q = HeldQueue()
    assert q.add(held("r1", offset=3))
    assert not q.add(held("r1", offset=9))
    assert len(q) == 1 and q.low(TP0) == 3


def test_a_cancel_takes_the_task_out_and_releases_its_offset() -> None:
    q = HeldQueue()
    q.add(held("r1", offset=1))
    q.add(held("r2", offset=2))
    assert q.low(TP0) == 1
    assert q.remove("r1") is not None and q.remove("r1") is None
    assert q.remove("r1") is None and q.low(TP0) == 2
    assert [h.request_id for h in [q.pop("cpu")] if h] == ["r2"]
    assert q.low(TP0) is None and q.count("cpu") == 0 and q.pools() == []


def test_expired_hands_back_exactly_those_out_of_time() -> None:
    q = HeldQueue()
    q.add(held("late", give_up_ms=100, offset=1))
    q.add(held("later", give_up_ms=200, offset=2))
    q.add(held("cancelled", give_up_ms=50, offset=3))
    q.remove("cancelled")
    assert [h.request_id for h in q.expired(150)] == ["late"]
    assert [h.request_id for h in q.expired(150)] == []
    assert q.low(TP0) == 2


def test_low_is_the_lowest_held_offset_per_partition() -> None:
    q = HeldQueue()
    q.add(held("a", tp=TP0, offset=10))
    q.add(held("b", tp=TP1, offset=4, priority=1))
    q.add(held("c", tp=TP0, offset=12, priority=1))
    assert (q.low(TP0), q.low(TP1)) == (10, 4)
    assert q.pop("cpu").request_id == "b"  # type: ignore[union-attr]
    assert q.pop("cpu").request_id == "c"  # type: ignore[union-attr]
    assert (q.low(TP0), q.low(TP1)) == (10, None)


def test_revoked_partitions_forget_their_tasks() -> None:
    q = HeldQueue()
    q.add(held("a", tp=TP0, offset=1))
    q.add(held("b", tp=TP1, offset=1))
    q.revoked([TP0])
    assert len(q) == 1 and q.remove("a") is None and q.low(TP0) is None
    assert q.pop("cpu").request_id == "b"  # type: ignore[union-attr]


N_HELD = 10_000  # enough to measure the bytes per task (tracemalloc makes it slow)


def test_ten_thousand_held_batch_tasks_are_cheap() -> None:
    """Held as their encoded bytes (about 270 bytes for this prompt) plus about
    420 bytes of bookkeeping, against about 2.4 KB for a decoded Task."""
    codec = default_codec()
    values = [codec.encode("Task", full_task(f"b{i:05d}", priority=2,
                                             prompt=f"Summarise line {i} of the batch."))
              for i in range(N_HELD)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    q = HeldQueue()
    for i, value in enumerate(values):
        q.add(held(f"b{i:05d}", offset=i, give_up_ms=10_000 + i, payload=value))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    for i in range(0, N_HELD, 2):  # a cancel of half of them
        q.remove(f"b{i:05d}")
    assert q.low(TP0) == 1
    released = [q.pop("cpu") for _ in range(N_HELD // 2)]
    assert [h.request_id for h in released[:2] if h] == ["b00001", "b00003"]
    assert len(q) == 0 and q.low(TP0) is None
    assert grown < N_HELD * 800, f"{grown / N_HELD:.0f} bytes per held task besides its value"
