"""RepeatFilter: an outage's repeated lines are held back, and counted."""

from __future__ import annotations

import logging

from conveyor.logs import RepeatFilter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(msg: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("aiokafka", level, __file__, 1, msg, None, None)


def test_a_repeated_line_passes_once_per_period_with_the_count_held_back() -> None:
    clock = Clock()
    f = RepeatFilter(every_s=10, clock=clock)
    assert f.filter(record("Unable connect to node %s"))
    shown = [f.filter(record("Unable connect to node %s")) for _ in range(700)]
    assert not any(shown)
    clock.now = 10.5
    later = record("Unable connect to node %s")
    assert f.filter(later)
    assert "700 more like this" in str(later.msg)


def test_other_lines_and_info_lines_are_not_held_back() -> None:
    f = RepeatFilter(every_s=10, clock=Clock())
    assert f.filter(record("a")) and f.filter(record("b"))
    assert all(f.filter(record("request done", logging.INFO)) for _ in range(5))


def test_two_handlers_with_one_filter_show_the_same_lines() -> None:
    f = RepeatFilter(every_s=10, clock=Clock())
    r = record("Heartbeat failed")
    assert f.filter(r) and f.filter(r)  # the second handler must not see a repeat
