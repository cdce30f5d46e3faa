"""ScheduleLayer with priorities: background and batch tasks wait in schedule
until a worker has room; interactive tasks never wait behind them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from aiokafka import TopicPartition

from conveyor.settings import load_settings
from tests.support.schedule_tasks import RecordingSender, beat, full_task, record_of
from topics.envelope import PRIORITY_BACKGROUND, PRIORITY_BATCH, now_ms
from workers.schedule.layer import ScheduleLayer

TP = TopicPartition("sched.routed", 0)


class Clock:
    def __init__(self) -> None:
        self.ms = now_ms()

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make(clock: Clock) -> Callable[..., tuple[ScheduleLayer, RecordingSender]]:
    def make(**options: object) -> tuple[ScheduleLayer, RecordingSender]:
        settings = load_settings(topic_prefix="sched", no_worker_timeout_s=5, batch_max_share=0.75,
                                 **options)
        layer = ScheduleLayer(settings, clock=clock)
        layer.table.clock = clock
        sender = RecordingSender()
        layer._sender = sender  # type: ignore[assignment]
        return layer, sender
    return make


async def submit(layer: ScheduleLayer, n: int, *, first_offset: int = 0, deadline_ms: int = 0,
                 priority: int = PRIORITY_BATCH, prefix: str = "b") -> list[str]:
    """``n`` batch tasks through handle; the ids of those sent at once."""
    sent = []
    for i in range(n):
        task = full_task(f"{prefix}{i}", priority=priority, deadline_ms=deadline_ms)
        outs = await layer.handle(task, record_of(task, 0, first_offset + i))
        sent += [o.record["envelope"]["request_id"] for o in outs]
    return sent


async def test_batch_fills_an_idle_pool_and_waits_in_schedule_for_the_rest(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    layer, sender = make()
    layer.table.apply(beat("w1", capacity=2, partitions=[3, 4], ts_ms=clock.ms))
    assert await submit(layer, 10) == ["b0", "b1"]  # no interactive traffic: every slot
    assert len(layer.held) == 8 and layer.committable(TP, 10) == 2
    await layer.release_held()
    assert sender.sent == []  # the worker is full: nothing more goes to its partitions
    # b0 ends: exactly one more goes, in order, decoded from the bytes read
    layer.finished("b0", "w1", clock.ms + 1)
    await layer.release_held()
    assert sender.ids() == ["b2"]
    out = sender.sent[0]
    assert out.partition in (3, 4) and out.record["route"]["worker_id"] == "w1"
    assert "schedule" in out.record["envelope"]["stamps"]
    assert layer.committable(TP, 10) == 3  # b2 was the lowest held offset


async def test_an_interactive_task_is_never_held_behind_batch(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    layer, _ = make()
    layer.table.apply(beat("w1", capacity=2, ts_ms=clock.ms))
    await submit(layer, 100)
    chat = full_task("chat")
    [out] = await layer.handle(chat, record_of(chat, 0, 100))
    assert out.record["envelope"]["request_id"] == "chat" and len(layer.held) == 98


async def test_while_interactive_traffic_is_around_batch_keeps_to_its_share(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    layer, sender = make(interactive_linger_s=2.0)
    for w, part in (("w1", 1), ("w2", 2)):  # capacity 4: the batch share is 3
        layer.table.apply(beat(w, capacity=2, partitions=[part], ts_ms=clock.ms))
    assert len(await submit(layer, 10)) == 4
    chat = full_task("chat")
    [out] = await layer.handle(chat, record_of(chat, 0, 10))  # into the full pool
    worker = out.record["route"]["worker_id"]
    # one batch task ends: its slot is the interactive task's, no batch task follows
    layer.finished("b0", "w1", clock.ms + 1)
    await layer.release_held()
    assert sender.sent == []
    # another ends: the batch is at 2 of its 3, one more goes
    layer.finished("b1", "w2", clock.ms + 1)
    await layer.release_held()
    assert sender.ids() == ["b4"]
    # the interactive answer ends, and its linger: batch takes every slot again
    layer.finished("chat", worker, clock.ms + 2)
    clock.ms += 2001
    await layer.release_held()
    assert sender.ids() == ["b4", "b5"]


async def test_background_goes_before_batch(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    layer, sender = make()
    layer.table.apply(beat("w1", capacity=1, ts_ms=clock.ms))
    await submit(layer, 3)
    await submit(layer, 2, first_offset=3, priority=PRIORITY_BACKGROUND, prefix="g")
    for rid in ("b0", "g0", "g1"):
        layer.finished(rid, "w1", clock.ms + 1)
        await layer.release_held()
    assert sender.ids() == ["g0", "g1", "b1"]


async def test_held_tasks_wait_for_busy_workers_past_the_no_worker_timeout(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    layer, sender = make()
    deadline = clock.ms + 60_000
    layer.table.apply(beat("w1", capacity=1, ts_ms=clock.ms))
    await submit(layer, 3, deadline_ms=deadline)
    for _ in range(4):  # 20 s of a busy worker: nothing fails
        clock.ms += 5000
        layer.table.apply(beat("w1", capacity=1, running=1, ts_ms=clock.ms))
        layer.reconcile()
        await layer.release_held()
    assert sender.errors == [] and len(layer.held) == 2
    # the deadline passes: 504, not 503
    clock.ms = deadline
    await layer.release_held()
    assert [(rid, e["status"], e["code"]) for rid, e in sender.errors] == [
        ("b1", 504, "deadline_exceeded"), ("b2", 504, "deadline_exceeded")]
    assert len(layer.held) == 0 and layer.committable(TP, 3) == 3


async def test_held_tasks_outlive_a_pool_without_workers(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    layer, sender = make()
    await submit(layer, 2, deadline_ms=clock.ms + 600_000)
    clock.ms += 30_000  # six no-worker timeouts later
    await layer.release_held()
    assert sender.errors == [] and len(layer.held) == 2
    layer.table.apply(beat("w1", capacity=2, ts_ms=clock.ms))  # a worker (re)starts
    await layer.release_held()
    assert sender.ids() == ["b0", "b1"]


async def test_a_cancelled_held_task_is_dropped(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    layer, sender = make()
    layer.table.apply(beat("w1", capacity=1, ts_ms=clock.ms))
    await submit(layer, 3)
    layer.cancel("b1")
    assert layer.committable(TP, 3) == 2
    layer.cancel("b0")  # the running one: its slot counts as free at once
    await layer.release_held()
    assert sender.ids() == ["b2"] and sender.errors == []


async def test_a_beat_with_room_frees_a_slot_whose_end_was_never_seen(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    layer, sender = make()
    layer.table.apply(beat("w1", capacity=1, ts_ms=clock.ms))
    await submit(layer, 2)
    # the worker skipped b0 (a duplicate) without a final chunk, and says it is idle
    clock.ms += 5000
    layer.table.apply(beat("w1", capacity=1, running=0, ts_ms=clock.ms))
    layer.reconcile()
    await layer.release_held()
    assert sender.ids() == ["b1"]


async def test_revoked_partitions_drop_their_held_tasks(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    layer, _ = make()
    await submit(layer, 2)
    layer.revoked([TP])
    assert len(layer.held) == 0 and layer.committable(TP, 5) == 5


async def test_held_tasks_go_only_to_workers_serving_their_model(
        make: Callable[..., tuple[ScheduleLayer, RecordingSender]], clock: Clock) -> None:
    """A worker that serves other models of the pool never gets a batch task of
    this one (workers/infer/engines/model_set.py), held or sent at once."""
    layer, sender = make()
    layer.table.apply({**beat("other", capacity=4, partitions=[1], ts_ms=clock.ms),
                       "models": ["smollm2-twin"]})
    assert await submit(layer, 2) == []  # nobody serves smollm2-135m-instruct yet
    layer.table.apply({**beat("mine", capacity=1, partitions=[2], ts_ms=clock.ms),
                       "models": ["smollm2-135m-instruct"], "loaded": []})
    await layer.release_held()
    assert sender.ids() == ["b0"] and sender.sent[0].record["route"]["worker_id"] == "mine"
    layer.finished("b0", "mine", clock.ms + 1)
    await layer.release_held()
    assert sender.ids() == ["b0", "b1"]
    assert {o.record["route"]["worker_id"] for o in sender.sent} == {"mine"}
