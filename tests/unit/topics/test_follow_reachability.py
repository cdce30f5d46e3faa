"""Follower.reachability: the follower's one liveness rule as a stream of
changes, each at the moment it happens (blind ``stale_after_s`` after the last
answer, seeing again at the next), without a broker: contact is what the
follower records when Kafka answers."""

from __future__ import annotations

import asyncio
import time

from conveyor.settings import load_settings
from topics.follow import Follower


def quick_follower() -> Follower:
    # blind 0.3 s after the last answer
    return Follower(load_settings(topic_prefix="t"), "t.replies", 0, "end", poll_ms=100,
                    probe_s=0.1, probe_timeout_s=0.1)


async def test_a_follower_that_never_heard_from_kafka_is_blind() -> None:
    follower = quick_follower()
    changes = follower.reachability()
    assert await changes.__anext__() is False
    assert not follower.reachable


async def test_each_change_comes_when_it_happens_and_only_changes_come() -> None:
    follower = quick_follower()
    follower._contact()
    changes = follower.reachability()
    assert await changes.__anext__() is True
    seen: list[tuple[bool, float]] = []
    t0 = time.monotonic()

    async def collect() -> None:
        async for reachable in changes:
            seen.append((reachable, time.monotonic() - t0))

    collecting = asyncio.create_task(collect())
    try:
        for _ in range(4):  # answers every 0.1 s keep it seeing: no change to report
            await asyncio.sleep(0.1)
            follower._contact()
        # the last answer, by the clock (four sleeps of 0.1 s run late on a loaded machine)
        last = time.monotonic() - t0
        assert seen == []
        await asyncio.sleep(0.5)  # silence past stale_after_s: blind, once
        assert [r for r, _ in seen] == [False]
        due = last + follower.stale_after_s  # the last answer, then the silence allowed
        assert due - 0.05 <= seen[0][1] <= due + 0.15, seen
        follower._contact()  # Kafka answers again: seeing at once
        await asyncio.sleep(0.02)
        assert [r for r, _ in seen] == [False, True]
    finally:
        collecting.cancel()
