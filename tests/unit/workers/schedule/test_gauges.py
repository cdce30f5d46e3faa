"""Schedule's gauges (workers/schedule/layer.py) under the Prometheus names:
each worker's breaker, the interactive tasks waiting for room, the batch tasks
held, the tasks sent and not finished."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from conveyor.metrics import Metrics
from conveyor.settings import load_settings
from tests.support.schedule_tasks import RecordingSender, beat, full_task, record_of
from workers.schedule.layer import ScheduleLayer


async def test_breakers_waiting_held_and_sent_are_gauges_of_the_layers_process() -> None:
    metrics = Metrics("layers")
    sched = ScheduleLayer(load_settings(topic_prefix="g"))
    sched._sender = RecordingSender()  # type: ignore[assignment]
    sched.instrument(metrics.meter)
    sched.table.apply(beat("w1", capacity=1))
    sched.table.apply(beat("w2", capacity=1, partitions=[4]))
    for i in range(3):  # two go out, one waits
        task = full_task(f"r{i}")
        await sched.handle(task, record_of(task, 0, i))
    for i in range(3):  # one batch task finds no room
        job = full_task(f"b{i}", priority=2)
        await sched.handle(job, record_of(job, 1, i))
    for _ in range(3):
        state = sched.breakers.ended("w2", "cpu", "x", "engine_error", "it broke")
        assert state is not None
        sched.breakers.apply(state)

    text = metrics.exposition().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("conveyor_schedule_breaker_state", conveyor_worker="w2",
                 conveyor_pool="cpu") == 2
    assert value("conveyor_schedule_waiting", conveyor_pool="cpu") == 1
    assert value("conveyor_schedule_held", conveyor_pool="cpu") == 3
    assert value("conveyor_schedule_sent", conveyor_worker="w1") == 1
    assert value("conveyor_schedule_sent", conveyor_worker="w2") == 1
