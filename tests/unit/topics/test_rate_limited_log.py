"""RateLimitedLog and its Throttle: a kind of trouble is said once a period,
with the count held back, and its end is said once."""

from __future__ import annotations

import logging

import pytest

from conveyor.logs import Throttle
from topics.backoff import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_kind_is_written_once_a_period_then_with_what_was_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("t.rll"), interval_s=10, clock=clock)
    with caplog.at_level(logging.WARNING, "t.rll"):
        assert log.warning("poll", "fetching failed (%s)", "down")
        assert not any(log.warning("poll", "fetching failed (%s)", "down") for _ in range(5))
        assert log.warning("commit", "commit failed")  # another kind is its own
        clock.now = 10.0
        assert log.warning("poll", "fetching failed (%s)", "down")
    assert [r.getMessage() for r in caplog.records] == [
        "fetching failed (down)", "commit failed",
        "fetching failed (down) (5 more like it in the last 10 s)"]


def test_resolved_is_said_once_and_only_after_trouble(
        caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("t.rll2"), interval_s=10, clock=Clock())
    with caplog.at_level(logging.INFO, "t.rll2"):
        log.resolved("redis", "never down: not said")
        log.warning("redis", "redis down")
        log.resolved("redis", "redis back")
        log.resolved("redis", "said twice")
        assert log.warning("redis", "redis down")  # afresh: at once
    assert [r.getMessage() for r in caplog.records] == ["redis down", "redis back",
                                                        "redis down"]


def test_a_throttle_forgets_everything_past_its_key_bound() -> None:
    clock = Clock()
    throttle = Throttle(10, clock, max_keys=3)
    assert [throttle.admit(k) for k in "abc"] == [0, 0, 0]
    assert throttle.admit("a") is None
    assert throttle.admit("d") == 0  # the fourth key: the others are forgotten
    assert throttle.admit("a") == 0
