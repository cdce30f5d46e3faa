"""The accounting app's watch for a partition it stopped counting
(workers/usage/app.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from conveyor.settings import load_settings
from topics.admin import Replication
from workers.usage.app import AccountingApp, Progress, consumer_state


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_partition_with_events_waiting_and_none_handled_is_a_stall() -> None:
    clock = Clock()
    progress = Progress(clock, stall_after_s=20)
    progress.handled("fb", 0, 9)
    clock.now += 5
    assert progress.stalls([("fb", 0, 30, 5)]) == []  # not idle long enough
    clock.now += 20
    [stall] = progress.stalls([("fb", 0, 30, 5)])
    assert (stall.topic, stall.partition, stall.handled, stall.highwater) == ("fb", 0, 9, 30)
    assert stall.idle_s == 25
    progress.handled("fb", 0, 10)  # counting again
    assert progress.stalls([("fb", 0, 30, 5)]) == []


def test_a_partition_handled_to_its_end_or_committed_there_is_not_a_stall() -> None:
    clock = Clock()
    progress = Progress(clock, stall_after_s=20)
    progress.handled("fb", 0, 29)
    # a member that took over a partition committed to its end has nothing to do
    assert progress.stalls([("fb", 0, 30, None), ("us", 1, 7, 7), ("us", 2, None, None)]) == []
    clock.now += 60
    assert progress.stalls([("fb", 0, 30, None), ("us", 1, 7, 7), ("us", 2, None, None)]) == []


def test_a_partition_never_handled_waits_from_when_it_is_first_seen() -> None:
    clock = Clock()
    progress = Progress(clock, stall_after_s=20)
    assert progress.stalls([("us", 3, 4, None)]) == []
    clock.now += 21
    [stall] = progress.stalls([("us", 3, 4, None)])
    assert stall.handled is None and stall.idle_s == 21


def test_the_app_says_which_partition_stopped_and_faust_s_state_of_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    app = AccountingApp(load_settings(topic_prefix="tprog"), Replication(1, 1, 1), home=tmp_path)
    tp = TopicPartition("tprog.feedback", 0)
    assert consumer_state(app.app, tp) == (
        "flow on, agents' flow off, fetched, read None, committed None, generation 0, "
        "rebalancing False")
    clock = Clock()
    app.progress = Progress(clock, stall_after_s=20)
    app.app.assignor.assigned_actives = lambda: {tp}  # type: ignore[method-assign]
    app.app.consumer.highwater = lambda tp: 601  # type: ignore[method-assign]
    app.check_progress()
    clock.now += 30
    with caplog.at_level(logging.WARNING, "workers.usage.app"):
        app.check_progress()
    assert "tprog.feedback[0] holds events up to 601, the last handled None" in caplog.text
    assert "agents' flow off" in caplog.text
