"""InFlightOffsets: the commit position of an infer worker's task partitions."""

from __future__ import annotations

from aiokafka import TopicPartition

from workers.inflight import InFlightOffsets

TP = TopicPartition("conveyor.infer.cpu", 0)
TP1 = TopicPartition("conveyor.infer.cpu", 1)


def test_nothing_taken_nothing_to_commit() -> None:
    assert InFlightOffsets().committable() == {}


def test_the_commit_never_passes_a_running_task() -> None:
    o = InFlightOffsets()
    for offset in (4, 5, 6):
        o.start(TP, offset)
    assert o.committable() == {TP: 4}
    o.finish(TP, 5)  # a later task ended first: still held by 4
    assert o.committable() == {TP: 4}
    o.finish(TP, 4)
    assert o.committable() == {TP: 6}


def test_with_nothing_running_the_commit_moves_past_the_last_task_taken() -> None:
    o = InFlightOffsets()
    o.start(TP, 4)
    o.start(TP, 5)
    o.finish(TP, 5)
    o.finish(TP, 4)
    assert o.committable() == {TP: 6}


def test_an_older_offset_taken_later_does_not_move_the_end_back() -> None:
    o = InFlightOffsets()
    o.start(TP, 9)
    o.finish(TP, 9)
    o.start(TP, 3)  # a redelivery after a seek
    o.finish(TP, 3)
    assert o.committable() == {TP: 10}


def test_an_older_offset_taken_while_a_later_runs_holds_the_commit() -> None:
    o = InFlightOffsets()
    o.start(TP, 9)
    o.start(TP, 3)  # a redelivery while 9 still runs
    assert o.committable() == {TP: 3}
    o.finish(TP, 3)
    assert o.committable() == {TP: 9}
    o.finish(TP, 9)
    assert o.committable() == {TP: 10}


def test_partitions_are_independent() -> None:
    o = InFlightOffsets()
    o.start(TP, 1)
    o.start(TP1, 7)
    o.finish(TP1, 7)
    assert o.committable() == {TP: 1, TP1: 8}


def test_finishing_an_unknown_task_is_harmless() -> None:
    o = InFlightOffsets()
    o.finish(TP, 3)
    assert o.committable() == {}


def test_forget_drops_revoked_partitions() -> None:
    o = InFlightOffsets()
    o.start(TP, 1)
    o.start(TP1, 2)
    o.forget([TP])
    assert o.committable() == {TP1: 2}
    o.finish(TP, 1)  # a task of the revoked partition ending late changes nothing
    assert o.committable() == {TP1: 2}
    o.forget([TP1, TP])
    assert o.committable() == {}


def test_a_generation_that_outlived_its_partition_does_not_free_a_retaken_offset() -> None:
    from aiokafka import TopicPartition

    from workers.inflight import InFlightOffsets

    tp = TopicPartition("t", 0)
    books = InFlightOffsets()
    old_epoch = books.start(tp, 5)
    books.forget([tp])  # revoked while offset 5 still generates
    new_epoch = books.start(tp, 5)  # assigned back: the task is taken again
    books.finish(tp, 5, old_epoch)  # the first generation ends late
    assert books.committable()[tp] == 5
    books.finish(tp, 5, new_epoch)
    assert books.committable()[tp] == 6
