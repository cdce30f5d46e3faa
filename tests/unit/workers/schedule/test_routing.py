"""Schedule sends a prompt where its prefix was sent before, within the load bound."""

from __future__ import annotations

from conveyor.settings import load_settings
from schemas.records import Task
from tests.support.schedule_tasks import RecordingSender, beat, full_task
from workers.schedule.layer import ScheduleLayer

SYSTEM = [11, 12, 13]  # the blocks of a long system prompt


def layer(**settings: object) -> ScheduleLayer:
    sched = ScheduleLayer(load_settings(topic_prefix="sched", **settings))  # type: ignore[arg-type]
    sched._sender = RecordingSender()  # type: ignore[assignment]
    sched.table.apply(beat("w0", partitions=[0], capacity=2))
    sched.table.apply(beat("w1", partitions=[1], capacity=2))
    return sched


def turn(rid: str, blocks: list[int]) -> Task:
    task = full_task(rid)
    task["prompt"]["prefix_blocks"] = blocks
    return task


def worker_of(sched: ScheduleLayer, task: Task) -> str:
    out = sched.place(task)
    assert out is not None
    return str(out.record["route"]["worker_id"])


def test_the_turns_of_a_conversation_stick_to_one_worker() -> None:
    sched = layer()
    other = worker_of(sched, turn("o1", [99, 98]))  # another conversation, still running
    first = worker_of(sched, turn("c1", SYSTEM))
    assert first != other  # least loaded: nobody holds its prefix yet
    sched.finished("c1", first, written_ms=sched.clock())
    # the next turn carries the history: it begins with the first turn's blocks
    assert worker_of(sched, turn("c2", [*SYSTEM, 14])) == first
    sched.finished("c2", first, written_ms=sched.clock())
    assert worker_of(sched, turn("c3", [*SYSTEM, 14, 15])) == first


def test_a_hot_prefix_spills_over_only_past_the_load_bound() -> None:
    sched = layer()
    placed = [worker_of(sched, turn(f"h{i}", [*SYSTEM, 100 + i])) for i in range(4)]
    # the holder takes a second one while the other is idle, not a third
    assert placed[:2] == [placed[0]] * 2 and placed[2] != placed[0]
    assert sorted(placed).count(placed[0]) == 2


def test_prefix_aware_routing_can_be_switched_off() -> None:
    sched = layer(route_prefix_aware=False)
    first = worker_of(sched, turn("c1", SYSTEM))
    assert worker_of(sched, turn("c2", [*SYSTEM, 14])) != first  # least loaded
