"""BatchAdmission: the batch share while interactive traffic is around, all of
the pool when it is not."""

from __future__ import annotations

from workers.schedule.held import BatchAdmission, Candidate


def cands(*loads: int, capacity: int = 2) -> list[Candidate]:
    return [Candidate(f"w{i}", capacity, load) for i, load in enumerate(loads)]


def test_the_cap_is_the_floor_of_the_share() -> None:
    a = BatchAdmission(share=0.75)
    assert [a.cap(c) for c in (1, 2, 4, 8, 16)] == [0, 1, 3, 6, 12]


def test_a_member_with_part_of_the_partitions_keeps_to_its_part_of_the_share() -> None:
    """Two schedule members with half the partitions each: 6 + 6 of 16 slots, the
    share of one member alone (12), not 12 each."""
    a = BatchAdmission(share=0.75, clock=lambda: 0)
    a.interactive_sent("cpu")
    a.fraction = 0.5
    assert a.cap(16) == 6
    assert a.choose("cpu", cands(0, 0, capacity=8), 5, 1) is not None
    assert a.choose("cpu", cands(3, 3, capacity=8), 6, 1) is None
    a.fraction = 1.0
    assert a.cap(16) == 12


def test_interactive_traffic_another_member_sent_is_seen_in_the_heartbeats() -> None:
    """This member sent no interactive task; the workers' beats say one runs, or
    one was taken within the linger: batch keeps to its share all the same."""
    now = [100_000]
    a = BatchAdmission(share=0.75, linger_s=2.0, clock=lambda: now[0])
    full = cands(3, 3, capacity=4)  # 6 of 8 slots held by batch: the cap
    assert a.choose("cpu", full, 6, 0) is not None  # alone, batch fills every slot
    assert a.choose("cpu", full, 6, 0, seen=(1, 0)) is None  # one runs elsewhere
    assert a.choose("cpu", full, 6, 0, seen=(0, 99_000)) is None  # taken 1 s ago
    assert a.choose("cpu", full, 6, 0, seen=(0, 97_000)) is not None  # 3 s ago: gone


def test_the_schedule_layer_takes_its_part_from_its_assignment() -> None:
    from aiokafka import TopicPartition

    from conveyor.settings import load_settings
    from workers.schedule.layer import ScheduleLayer

    settings = load_settings(topic_prefix="frac", pipeline_partitions=4)
    layer = ScheduleLayer(settings)
    topic = settings.kafka.topic("routed")
    layer.assigned([TopicPartition(topic, 0), TopicPartition(topic, 3)])
    assert layer.admission.fraction == 0.5
    layer.assigned([TopicPartition(topic, p) for p in range(4)])
    assert layer.admission.fraction == 1.0


def test_without_interactive_traffic_batch_fills_every_slot() -> None:
    a = BatchAdmission(share=0.75, clock=lambda: 0)
    assert a.choose("cpu", cands(1, 0), 1, 0).worker_id == "w1"  # type: ignore[union-attr]
    assert a.choose("cpu", cands(2, 1), 3, 0).worker_id == "w1"  # type: ignore[union-attr]
    assert a.choose("cpu", cands(2, 2), 4, 0) is None
    assert a.choose("cpu", [], 0, 0) is None


def test_a_prefetch_queues_that_many_more_per_worker_when_alone() -> None:
    a = BatchAdmission(share=0.75, prefetch=1, clock=lambda: 0)
    assert a.choose("cpu", cands(2), 2, 0) is not None
    assert a.choose("cpu", cands(3), 3, 0) is None


def test_with_interactive_traffic_batch_keeps_to_its_share() -> None:
    clock = [10_000]
    a = BatchAdmission(share=0.75, prefetch=1, linger_s=2.0, clock=lambda: clock[0])
    # an interactive task is running: capacity 4, share 3
    assert a.choose("cpu", cands(1, 1), 2, 1) is not None
    assert a.choose("cpu", cands(2, 2), 3, 1) is None  # batch holds its 3 slots
    # no prefetch while interactive traffic is around: only free slots count
    assert a.choose("cpu", cands(2, 1), 2, 0) is not None
    a.interactive_sent("cpu")
    assert a.choose("cpu", cands(2, 1), 3, 0) is None
    # the linger ends: batch may take everything again
    clock[0] += 2001
    assert a.choose("cpu", cands(2, 1), 3, 0) is not None
    # another pool never saw interactive traffic
    a.interactive_sent("gpu")
    assert a.choose("cpu", cands(2, 1), 3, 0) is not None


def test_a_pool_of_one_slot_leaves_it_to_interactive_traffic() -> None:
    a = BatchAdmission(share=0.75, clock=lambda: 0)
    assert a.choose("cpu", cands(0, capacity=1), 0, 1) is None
    assert a.choose("cpu", cands(0, capacity=1), 0, 0) is not None
