"""Admission of interactive tasks (workers/schedule/room.py): a task goes to a
worker with a free slot and free KV for its prompt plus max_tokens, else waits
in schedule, in order, until ``schedule_timeout_s`` (503 server_overloaded),
or is refused at once past ``schedule_queue_max``; one no worker could ever
hold is a 400 naming the limit; batch work never keeps it from a slot; once
overdue it goes to a fallback with room."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.errors import ContextLengthExceeded, Overloaded
from conveyor.settings import load_settings
from schemas.records import KvCache, Task, WorkerHeartbeat
from tests.support.schedule_tasks import RecordingSender, beat, full_task, record_of
from topics.envelope import now_ms
from workers.schedule.layer import ScheduleLayer
from workers.schedule.room import free_kv, has_room, kv_need
from workers.schedule.table import WorkerView


class Clock:
    def __init__(self) -> None:
        self.ms = now_ms()

    def __call__(self) -> int:
        return self.ms


def kv(total: int, free: int, block_tokens: int = 16) -> KvCache:
    return KvCache(usage=1 - free / total, total_blocks=total, free_blocks=free,
                   cached_blocks=None, block_tokens=block_tokens, prefix_queries=0,
                   prefix_hits=0)


def with_kv(worker: str, cache: KvCache, **kw: Any) -> WorkerHeartbeat:
    b = beat(worker, **kw)
    b["kv"] = cache
    return b


def sized(rid: str, prompt: int, max_tokens: int, **kw: Any) -> Task:
    task = full_task(rid, **kw)
    task["prompt"]["tokens"], task["prompt"]["max_tokens"] = prompt, max_tokens
    return task


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, **settings: Any) -> tuple[ScheduleLayer, RecordingSender]:
    sched = ScheduleLayer(load_settings(topic_prefix="sched", **settings), clock=clock)
    sender = RecordingSender()
    sched._sender = sender  # type: ignore[assignment]
    return sched, sender


async def submit(sched: ScheduleLayer, task: Task, offset: int) -> list[Any]:
    return await sched.handle(task, record_of(task, 0, offset))


def test_kv_is_counted_in_tokens_less_what_was_sent_since_the_beat() -> None:
    view = WorkerView(with_kv("w", kv(total=100, free=10)))  # 160 tokens free
    need = kv_need(sized("r", prompt=100, max_tokens=50))
    assert need == 150 and free_kv(view) == 160 and has_room(view, 0, need)
    view.kv_since_beat = 20
    assert not has_room(view, 0, need)
    assert not has_room(WorkerView(beat("w")), 2, 1)  # no KV reported: slots only
    assert has_room(WorkerView(beat("w")), 1, 10**9)


async def test_a_full_worker_makes_the_task_wait_in_order_until_a_slot_frees(
        clock: Clock) -> None:
    sched, sender = make(clock)
    sched.table.apply(beat("w1", capacity=2, ts_ms=clock.ms))
    assert len(await submit(sched, full_task("a"), 0)) == 1
    assert len(await submit(sched, full_task("b"), 1)) == 1
    assert await submit(sched, full_task("c"), 2) == []  # both slots taken
    assert await submit(sched, full_task("d"), 3) == []
    await sched.place_parked()
    assert sender.sent == [] and sched.committable(record_tp(), 4) == 2
    sched.finished("a", "w1", clock.ms + 1)
    await sched.place_parked()
    assert sender.ids() == ["c"]  # in arrival order, one per freed slot
    assert [p.task["envelope"]["request_id"] for p in sched.parked] == ["d"]


async def test_a_task_with_no_room_in_time_is_503_overloaded(clock: Clock) -> None:
    sched, sender = make(clock, schedule_timeout_s=5, no_worker_timeout_s=60)
    sched.table.apply(beat("w1", capacity=1, ts_ms=clock.ms))
    await submit(sched, full_task("a"), 0)
    waiting = full_task("b")
    waiting["envelope"]["stamps"]["gateway"] = clock.ms * 1000
    assert await submit(sched, waiting, 1) == []
    clock.ms += 4_900
    await sched.place_parked()
    assert sender.errors == []
    clock.ms += 200
    await sched.place_parked()
    [(rid, error)] = sender.errors
    assert rid == "b" and error["status"] == 503 and error["code"] == "server_overloaded"
    assert "no worker had room for it within 5 s" in error["message"]
    assert sched.parked == []


async def test_past_the_queue_bound_a_task_is_refused_at_once(clock: Clock) -> None:
    sched, _ = make(clock, schedule_queue_max=2)
    sched.table.apply(beat("w1", capacity=1, ts_ms=clock.ms))
    await submit(sched, full_task("a"), 0)
    assert await submit(sched, full_task("b"), 1) == []
    assert await submit(sched, full_task("c"), 2) == []
    with pytest.raises(Overloaded, match="too many requests are waiting"):
        await submit(sched, full_task("d"), 3)


async def test_kv_decides_room_and_a_task_no_worker_could_hold_is_a_400(clock: Clock) -> None:
    sched, sender = make(clock)
    # 4 slots, 64 blocks of 16 tokens: 1,024 tokens in all, 320 free
    sched.table.apply(with_kv("w1", kv(total=64, free=20), capacity=4, ts_ms=clock.ms))
    assert len(await submit(sched, sized("a", 100, 100), 0)) == 1  # 200 of 320
    assert await submit(sched, sized("b", 100, 100), 1) == []  # 120 left: it waits
    sched.table.apply(with_kv("w1", kv(total=64, free=40), capacity=4, ts_ms=clock.ms + 1))
    await sched.place_parked()
    assert sender.ids() == ["b"]  # the next beat shows room
    with pytest.raises(ContextLengthExceeded, match="1024 tokens") as never:
        await submit(sched, sized("huge", 900, 200), 2)
    assert never.value.status == 400 and never.value.param == "max_tokens"


async def test_batch_work_never_keeps_an_interactive_task_from_a_slot(clock: Clock) -> None:
    sched, _ = make(clock)
    sched.table.apply(beat("w1", capacity=2, ts_ms=clock.ms))
    for i in range(2):  # an idle pool: batch takes every slot
        job = full_task(f"b{i}", priority=2)
        assert len(await sched.handle(job, record_of(job, 0, i))) == 1
    [out] = await submit(sched, full_task("chat"), 2)
    assert out.record["route"]["worker_id"] == "w1"


async def test_an_overdue_task_goes_to_a_fallback_with_room(clock: Clock) -> None:
    sched, sender = make(clock, schedule_timeout_s=2)
    sched.table.apply(beat("w1", capacity=1, ts_ms=clock.ms))
    sched.table.apply(beat("g1", pool="gpu", partitions=[0], ts_ms=clock.ms))
    await submit(sched, full_task("a"), 0)
    waiting = full_task("b")
    waiting["envelope"]["stamps"]["gateway"] = clock.ms * 1000
    waiting["route"]["fallbacks"] = [{"model": "big", "pool": "gpu"}]
    assert await submit(sched, waiting, 1) == []  # its own pool is live: it waits first
    clock.ms += 2_500
    await sched.place_parked()
    [out] = sender.sent
    assert out.topic == "sched.infer.gpu" and out.record["route"]["model"] == "big"
    assert out.record["route"]["fallback_from"] == "smollm2-135m-instruct"


def record_tp() -> Any:
    from aiokafka import TopicPartition

    return TopicPartition("sched.routed", 0)
