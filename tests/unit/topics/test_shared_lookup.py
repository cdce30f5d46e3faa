"""The process's keyed lookup over scripted readers: readers are made on first
use and reused, never shared by two calls at once, replaced after any call
that failed or was cut short, and every call is bounded by its timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiokafka.errors import KafkaConnectionError, NodeNotReadyError

from conveyor.errors import TransientBrokerError
from conveyor.settings import load_settings
from topics.lookup import LookupClosed, Record, SharedLookup

Behaviour = Callable[["ScriptedReader", str | None], Awaitable[list[Any]]]


async def answer(reader: ScriptedReader, key: str | None) -> list[Any]:
    await asyncio.sleep(0.01)
    return [f"{key}@{reader.number}"]


class ScriptedReader:
    """A reader whose calls do what the test says; it notes overlapping use."""

    def __init__(self, number: int, lookup: Readers, behaviour: Behaviour,
                 start_fails: bool = False) -> None:
        self.number = number
        self.lookup = lookup
        self.behaviour = behaviour
        self.start_fails = start_fails
        self.read: dict[str, list[tuple[int, int, int]]] = {}
        self.started = self.closed = False
        self.busy = False

    async def start(self) -> None:
        if self.start_fails:
            raise KafkaConnectionError("no broker")
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def partitions(self, topic: str) -> list[int]:
        return [0, 1]

    async def find(self, topic: str, key: str | None, since_ms: int,
                   until_ms: int | None = None, *, partitions: list[int] | None = None,
                   first: bool = False) -> list[Record]:
        assert not self.busy and not self.closed, "a reader serves one call at a time"
        self.busy = True
        self.lookup.in_use += 1
        self.lookup.most_in_use = max(self.lookup.most_in_use, self.lookup.in_use)
        try:
            self.read.setdefault(topic, []).append((0, 0, 1))
            return await self.behaviour(self, key)
        finally:
            self.busy = False
            self.lookup.in_use -= 1

    async def at(self, topic: str, partition: int, offset: int) -> Record | None:
        return None


class Readers:
    """Makes scripted readers: the n-th made behaves as ``behaviours[n]`` (else answers)."""

    def __init__(self, *behaviours: Behaviour, start_fails: tuple[int, ...] = ()) -> None:
        self.behaviours = list(behaviours)
        self.start_fails = start_fails
        self.made: list[ScriptedReader] = []
        self.in_use = self.most_in_use = 0

    def __call__(self) -> ScriptedReader:
        n = len(self.made)
        behaviour = self.behaviours[n] if n < len(self.behaviours) else answer
        reader = ScriptedReader(n, self, behaviour, start_fails=n in self.start_fails)
        self.made.append(reader)
        return reader


def shared(readers: Readers, size: int = 4, timeout_s: float = 2.0) -> SharedLookup:
    return SharedLookup(load_settings(topic_prefix="lk"), readers=size, timeout_s=timeout_s,
                        make_reader=readers)


async def test_readers_are_made_on_first_use_and_reused() -> None:
    readers = Readers()
    lookup = shared(readers)
    assert readers.made == []  # nothing connects until a call needs it
    assert await lookup.records("t", "a", 0) == ["a@0"]
    assert await lookup.records("t", "b", 0) == ["b@0"]
    assert len(readers.made) == 1 and lookup.started == 1
    assert readers.made[0].read == {}  # what one call read is not kept for the next
    await lookup.close()
    assert readers.made[0].closed


async def test_concurrent_calls_never_share_a_reader_and_stay_within_the_pool() -> None:
    readers = Readers()
    lookup = shared(readers, size=3)
    keys = [f"k{i}" for i in range(20)]
    found = await asyncio.gather(*(lookup.records("t", key, 0) for key in keys))
    assert [hit[0].split("@")[0] for hit in found] == keys
    assert len(readers.made) == 3 and readers.most_in_use == 3
    assert lookup.idle == 3
    await lookup.close()


async def test_a_reader_that_failed_is_closed_and_never_used_again() -> None:
    async def broken(reader: ScriptedReader, key: str | None) -> list[Any]:
        raise NodeNotReadyError("leader moving")

    readers = Readers(broken)
    lookup = shared(readers)
    with pytest.raises(TransientBrokerError, match="NodeNotReady"):
        await lookup.records("t", "a", 0)  # a fresh reader's failure is the caller's
    await asyncio.sleep(0.05)  # the failed reader closes in the background
    assert readers.made[0].closed and lookup.discarded == 1
    assert await lookup.records("t", "b", 0) == ["b@1"]
    await lookup.close()


async def test_a_reused_reader_that_fails_is_replaced_within_the_same_call() -> None:
    calls = 0

    async def dies_on_second_use(reader: ScriptedReader, key: str | None) -> list[Any]:
        nonlocal calls
        calls += 1
        if calls == 2:  # the broker restarted while the reader sat idle
            raise KafkaConnectionError("connection reset")
        return await answer(reader, key)

    readers = Readers(dies_on_second_use)
    lookup = shared(readers)
    assert await lookup.records("t", "a", 0) == ["a@0"]
    assert await lookup.records("t", "b", 0) == ["b@1"]
    assert readers.made[0].closed and lookup.started == 2
    await lookup.close()


async def test_a_call_is_bounded_by_its_timeout_and_its_reader_replaced() -> None:
    async def hangs(reader: ScriptedReader, key: str | None) -> list[Any]:
        await asyncio.sleep(60)
        return []

    readers = Readers(hangs)
    lookup = shared(readers, timeout_s=0.2)
    started = asyncio.get_running_loop().time()
    with pytest.raises(TransientBrokerError, match="no answer within 0.2 s"):
        await lookup.records("t", "a", 0)
    assert asyncio.get_running_loop().time() - started < 1.0
    await asyncio.sleep(0.05)  # the failed reader closes in the background
    assert readers.made[0].closed
    assert await lookup.records("t", "b", 0, timeout_s=1.0) == ["b@1"]
    await lookup.close()


async def test_waiting_for_a_reader_counts_against_the_timeout() -> None:
    async def slow(reader: ScriptedReader, key: str | None) -> list[Any]:
        await asyncio.sleep(0.5)
        return ["slow"]

    lookup = shared(Readers(slow), size=1)
    first = asyncio.create_task(lookup.records("t", "a", 0, timeout_s=2.0))
    await asyncio.sleep(0.05)
    with pytest.raises(TransientBrokerError):
        await lookup.records("t", "b", 0, timeout_s=0.1)  # the one reader is busy
    assert await first == ["slow"]
    await lookup.close()


async def test_a_call_its_caller_cancelled_leaves_no_half_used_reader() -> None:
    async def hangs(reader: ScriptedReader, key: str | None) -> list[Any]:
        await asyncio.sleep(60)
        return []

    readers = Readers(hangs)
    lookup = shared(readers)
    call = asyncio.create_task(lookup.records("t", "a", 0))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.sleep(0.05)  # the failed reader closes in the background
    assert readers.made[0].closed and lookup.idle == 0
    assert await lookup.records("t", "b", 0) == ["b@1"]
    await lookup.close()


async def test_a_reader_that_cannot_start_is_closed_and_the_next_call_starts_another(
) -> None:
    readers = Readers(start_fails=(0,))
    lookup = shared(readers)
    with pytest.raises(TransientBrokerError, match="no broker"):
        await lookup.records("t", "a", 0)
    await asyncio.sleep(0.05)  # the failed reader closes in the background
    assert readers.made[0].closed and lookup.started == 0
    assert await lookup.records("t", "b", 0) == ["b@1"]
    await lookup.close()


async def test_an_error_of_another_kind_is_raised_as_it_is() -> None:
    async def wrong(reader: ScriptedReader, key: str | None) -> list[Any]:
        raise ValueError("not a broker error")

    readers = Readers(wrong)
    lookup = shared(readers)
    with pytest.raises(ValueError):
        await lookup.records("t", "a", 0)
    await asyncio.sleep(0.05)  # the failed reader closes in the background
    assert readers.made[0].closed
    await lookup.close()


async def test_close_stops_every_reader_and_refuses_later_calls() -> None:
    async def slow(reader: ScriptedReader, key: str | None) -> list[Any]:
        await asyncio.sleep(0.3)
        return ["late"]

    readers = Readers(answer, slow)
    lookup = shared(readers)
    await lookup.records("t", "a", 0)  # reader 0 is idle now
    busy = asyncio.create_task(lookup.records("t", "b", 0, timeout_s=1.0))
    second = asyncio.create_task(lookup.records("t", "c", 0))
    await asyncio.sleep(0.05)
    await lookup.close()
    assert all(r.closed for r in readers.made)
    await asyncio.gather(busy, second, return_exceptions=True)
    with pytest.raises(LookupClosed):
        await lookup.records("t", "d", 0)
    assert isinstance(LookupClosed("x"), TransientBrokerError)


def test_a_lookup_needs_a_reader() -> None:
    with pytest.raises(ValueError):
        SharedLookup(load_settings(topic_prefix="lk"), readers=0)
