"""The process's one keyed lookup: long-lived readers every caller shares.

    lookup = SharedLookup(settings)          # made at start; nothing connects yet
    records = await lookup.find(topic, request_id, since_ms, until_ms)
    await lookup.close()                     # at shutdown

A :class:`~topics.lookup.KeyLookup` costs a consumer and a metadata producer
that must connect and learn the cluster before the first read: made per
call, that start was most of a resume's ``locate``. Here the readers are made
on first use and kept: a call takes an idle reader, or starts one when none is
idle and fewer than ``readers`` exist, and hands it back when it is done.
Measured: docs/decisions/0021-one-shared-lookup.md.

Why a small pool and not one reader behind a lock. A reader's assignment,
positions and fetch buffer are single-caller state, so a reader serves one
call at a time either way. One reader is enough for the rate of callers
(resumes, stored answers, retried tasks: each a few milliseconds), but behind
a lock one slow call (a window of an hour over a busy partition, or a
partition whose leader is moving) holds every other caller until its timeout.
With ``readers`` (4) the short calls pass it; the readers exist only as the
callers' concurrency asked for them (an idle gateway holds one or none), and
4 of them are 8 connections. The pool is for the slow call, not for speed:
a burst with nothing slow in it is no faster with four readers.

Restart rule. A reader goes back to the pool only after a call that
returned normally. A broker error, a timeout or a caller's cancellation
leaves a reader whose assignment and fetches may be half done: it is closed
(in the background, bounded) and forgotten, and the next call starts a fresh
one, so a broken consumer never poisons a later lookup. A call whose
*reused* reader fails with a broker error is tried again on the next reader,
until one that was started for it answers or fails, all within the call's
time: idle readers that outlived a broker restart cost their caller nothing
but their replacement.

Every call is bounded by its ``timeout_s`` (the waiting for a reader
included), and aiokafka's errors leave here as Conveyor's
(:func:`~topics.clients.broker_error`): :class:`TransientBrokerError` for a
broker that does not answer in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from conveyor.errors import BrokerError, TransientBrokerError
from conveyor.settings import Settings
from topics.clients import KafkaError, broker_error
from topics.lookup import KeyLookup, Record

__all__ = ["SharedLookup", "Reader", "LookupClosed"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_BROKER_TROUBLE = (KafkaError, OSError, TimeoutError)
_CLOSE_WITHIN_S = 5.0


class LookupClosed(TransientBrokerError):
    """A call after the process's lookup was closed (it is shutting down)."""


class Reader(Protocol):
    """What the pool needs of a reader (:class:`~topics.lookup.KeyLookup`)."""

    read: dict[str, list[tuple[int, int, int]]]

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def partitions(self, topic: str) -> list[int]: ...

    async def find(self, topic: str, key: str | None, since_ms: int,
                   until_ms: int | None = None, *, partitions: list[int] | None = None,
                   first: bool = False) -> list[Record]: ...

    async def at(self, topic: str, partition: int, offset: int) -> Record | None: ...


class SharedLookup:
    """Up to ``readers`` long-lived readers shared by every caller; see the module."""

    def __init__(self, settings: Settings, *, readers: int = 4, timeout_s: float = 10.0,
                 make_reader: Callable[[], Reader] | None = None) -> None:
        if readers < 1:
            raise ValueError("a lookup needs at least one reader")
        self.settings = settings
        self.timeout_s = timeout_s
        self.size = readers
        self._make = make_reader or (lambda: KeyLookup(settings, timeout_s=timeout_s))
        self._slots = asyncio.Semaphore(readers)
        self._idle: list[Reader] = []
        self._live: set[Reader] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False
        self.started = 0  # readers started so far
        self.discarded = 0  # readers closed after a failed or cut-short call

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def find(self, topic: str, key: str | None, since_ms: int,
                   until_ms: int | None = None, *, partitions: list[int] | None = None,
                   first: bool = False, timeout_s: float | None = None) -> list[Record]:
        """:meth:`KeyLookup.find <topics.lookup.KeyLookup.find>` on a shared reader,
        within ``timeout_s`` (the lookup's own when None)."""
        async def use(reader: Reader) -> list[Record]:
            return await reader.find(topic, key, since_ms, until_ms,
                                     partitions=partitions, first=first)

        return await self._call(f"finding {key!r} in {topic}", use, timeout_s)

    async def at(self, topic: str, partition: int, offset: int, *,
                 timeout_s: float | None = None) -> Record | None:
        """The record at one offset, or None when there is none (any more)."""
        async def use(reader: Reader) -> Record | None:
            return await reader.at(topic, partition, offset)

        return await self._call(f"reading {topic}[{partition}]@{offset}", use, timeout_s)

    async def partitions(self, topic: str, *, timeout_s: float | None = None) -> list[int]:
        """The topic's partitions."""
        async def use(reader: Reader) -> list[int]:
            return await reader.partitions(topic)

        return await self._call(f"the partitions of {topic}", use, timeout_s)

    async def close(self) -> None:
        """Close every reader, idle or busy (a busy call then fails); later calls
        raise :class:`LookupClosed`."""
        self._closed = True
        for reader in list(self._live):
            self._discard(reader, failed=False)
        self._idle.clear()
        while self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    # -- one call -----------------------------------------------------------

    async def _call(self, what: str, use: Callable[[Reader], Awaitable[T]],
                    timeout_s: float | None) -> T:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):
                return await self._attempts(use)
        except BrokerError:
            raise
        except TimeoutError as exc:
            raise TransientBrokerError(f"{what}: no answer within {limit:g} s") from exc
        except (KafkaError, OSError) as exc:
            raise broker_error(exc) from exc

    async def _attempts(self, use: Callable[[Reader], Awaitable[T]]) -> T:
        async with self._slots:
            fresh = False
            while True:
                reader, fresh = await self._take()
                try:
                    result = await use(reader)
                except _BROKER_TROUBLE as exc:
                    self._discard(reader)
                    if fresh:
                        raise
                    log.info("keyed lookup: a reader failed (%r); trying a fresh one", exc)
                    continue  # the failed reader was reused: once more, on a new one
                except BaseException:  # another error, or the call was cut short
                    self._discard(reader)
                    raise
                self._give_back(reader)
                return result

    async def _take(self) -> tuple[Reader, bool]:
        """An idle reader, or a new started one (True)."""
        if self._closed:
            raise LookupClosed("the keyed lookup is closed")
        if self._idle:
            return self._idle.pop(), False
        reader = self._make()
        self._live.add(reader)
        try:
            await reader.start()
        except BaseException:
            self._discard(reader)
            raise
        self.started += 1
        return reader, True

    def _give_back(self, reader: Reader) -> None:
        reader.read.clear()  # what a call read is its own; kept, it would grow for ever
        if self._closed:
            self._discard(reader, failed=False)
        else:
            self._idle.append(reader)

    def _discard(self, reader: Reader, *, failed: bool = True) -> None:
        """Close ``reader`` in the background and forget it."""
        if reader not in self._live:
            return
        self._live.discard(reader)
        with contextlib.suppress(ValueError):
            self._idle.remove(reader)
        self.discarded += failed
        task = asyncio.create_task(_close(reader), name="lookup-reader-close")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


async def _close(reader: Reader) -> None:
    try:
        await asyncio.wait_for(reader.close(), _CLOSE_WITHIN_S)
    except Exception as exc:  # the reader is forgotten either way
        log.info("keyed lookup: closing a reader failed: %r", exc)
