"""``hold_fetches`` changes two private fields of aiokafka's fetcher: pinned
here, so that an aiokafka that builds its fetches otherwise fails this test
instead of leaving idle batching followers asking every few milliseconds."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

from aiokafka.consumer.fetcher import Fetcher

from conveyor.settings import load_settings
from topics.clients import IDLE_FETCH_WAIT_MS, hold_fetches
from topics.follow import Follower


def test_aiokafka_builds_each_fetch_from_the_two_fields() -> None:
    source = inspect.getsource(Fetcher._get_actions_per_node)
    assert "self._fetch_max_wait_ms," in source
    assert "self._fetch_min_bytes," in source
    init = inspect.getsource(Fetcher.__init__)
    assert "self._fetch_max_wait_ms = fetch_max_wait_ms" in init
    assert "self._fetch_min_bytes = fetch_min_bytes" in init


def _consumer() -> Any:
    return SimpleNamespace(_fetcher=SimpleNamespace(_fetch_max_wait_ms=0, _fetch_min_bytes=0))


def test_hold_fetches_sets_them() -> None:
    consumer = _consumer()
    hold_fetches(consumer, 20, 4096)
    assert (consumer._fetcher._fetch_max_wait_ms, consumer._fetcher._fetch_min_bytes) == (20, 4096)


def test_a_batching_follower_holds_for_a_batch_or_waits_as_an_idle_one() -> None:
    batching: Follower[Any] = Follower(load_settings(), "t", 0, fetch_max_wait_ms=20,
                                       fetch_min_bytes=1 << 18)
    plain: Follower[Any] = Follower(load_settings(), "t", 0)
    assert batching._batching and not plain._batching
    consumer = _consumer()
    batching._hold(consumer, False)
    assert vars(consumer._fetcher) == {"_fetch_max_wait_ms": IDLE_FETCH_WAIT_MS,
                                       "_fetch_min_bytes": 1}
    batching._hold(consumer, True)
    assert vars(consumer._fetcher) == {"_fetch_max_wait_ms": 20, "_fetch_min_bytes": 1 << 18}
