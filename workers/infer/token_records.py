"""An infer worker's records on ``conveyor.tokens``: the chunks of every stream
it runs, one record a partition a tick
(docs/decisions/0032-many-streams-a-record.md).

A run hands over a chunk whole (:meth:`TokenRecords.add`) or says it holds
pieces (:meth:`TokenRecords.wants`), which the next tick takes as one chunk. A
tick comes every ``coalesce_ms`` times (1 - 1/streams), stretched towards
``coalesce_max_ms`` while ticks run late (:class:`Stretch`); a chunk given
``at_once`` (a first or a last one) does not wait for it. Each chunk's future
is done when its record is in the log. A partition's records leave in the
order their chunks were given, through one idempotent producer, so a
request's chunks stay in seq order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from conveyor.settings import Settings
from schemas.records import TokenChunk
from topics.catalog import TOKENS
from topics.lookup import key_partition
from workers.outputs import RECORD_MARGIN, Output, Sender, batch_output, event_bytes

__all__ = ["Pieces", "Stretch", "TokenRecords"]

log = logging.getLogger(__name__)

_Given = tuple[TokenChunk, int, "asyncio.Future[None]"]


class Pieces(Protocol):
    """A run holding pieces not yet in a chunk."""

    def take(self) -> _Given | None:
        """Its held pieces as one chunk, with its partition and future (None: none held)."""


class Stretch:
    """How much wider than ``coalesce_ms`` the window is: a tick that wakes
    later than asked, by more than a tenth of the window on average (an event
    loop short of CPU), widens it by a fifth, up to ``most``; one on time
    narrows it by a tenth, down to 1."""

    def __init__(self, most: float) -> None:
        self.most = max(1.0, most)
        self.factor = 1.0
        self.late_s = 0.0  # how late ticks wake, on average

    def woke(self, late_s: float, window_s: float) -> None:
        self.late_s += 0.2 * (max(0.0, late_s) - self.late_s)
        if self.late_s > 0.1 * window_s:
            self.factor = min(self.most, self.factor * 1.2)
        else:
            self.factor = max(1.0, self.factor / 1.1)


class TokenRecords:
    def __init__(self, settings: Settings, sender: Sender,
                 streams: Callable[[], int] = lambda: 1) -> None:
        self.settings = settings
        self.sender = sender
        self.streams = streams
        self.coalesce_s = settings.infer.coalesce_ms / 1000
        most = settings.infer.coalesce_max_ms / settings.infer.coalesce_ms \
            if settings.infer.coalesce_ms > 0 else 1.0
        self.stretch = Stretch(most)
        self.partitions = TOKENS.partitions(settings.kafka)
        self._ready: list[_Given] = []
        self._holding: dict[int, Pieces] = {}
        self._wake = asyncio.Event()
        self._at_once = asyncio.Event()
        self._last_tick = 0.0
        self._task: asyncio.Task[None] | None = None
        self.records = 0  # records written, for the benchmarks' figures

    def partition(self, request_id: str) -> int:
        """The partition of ``request_id``'s chunks: its key's, as a keyed record's."""
        return key_partition(request_id.encode(), self.partitions)

    def window_s(self) -> float:
        return self.coalesce_s * self.stretch.factor * (1 - 1 / max(1, self.streams()))

    def add(self, chunk: TokenChunk, partition: int, at_once: bool) -> asyncio.Future[None]:
        """Give a whole chunk; done once its record is in the log."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ready.append((chunk, partition, done))
        self._wake.set()
        if at_once:
            self._at_once.set()
        return done

    def wants(self, pieces: Pieces) -> None:
        """``pieces`` holds pieces for the next tick to take."""
        self._holding[id(pieces)] = pieces
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="token-records")

    async def close(self) -> None:
        """Stop ticking and write the chunks given (best effort: a worker
        stopping hands its answers over through the log). Pieces runs still
        hold are not taken: those runs were stopped, and the task's next owner
        generates them again after the last chunk in the log."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.flush(tick=False), 5.0)

    async def _run(self) -> None:
        while True:
            busy = self._wake.is_set()  # pieces were left at the last tick
            await self._wake.wait()
            self._wake.clear()
            if not self._at_once.is_set():
                window = self.window_s()
                due = self._last_tick + window - time.monotonic()
                if due > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._at_once.wait(), due)
                        due = 0.0  # woken by a first or last chunk, not the timer
                    if due:
                        self.stretch.woke(time.monotonic() - self._last_tick - window, window)
                elif busy:  # the last tick's work ran past this one
                    self.stretch.woke(-due, window)
            self._at_once.clear()
            now = time.monotonic()
            tick = now >= self._last_tick + self.window_s()
            if tick:
                self._last_tick = now
            try:
                await self.flush(tick)
            except Exception:  # each chunk's future holds the failure; never stop ticking
                log.exception("token records: a write failed")
            if self._ready or self._holding:
                self._wake.set()

    async def flush(self, tick: bool) -> None:
        """Write what is ready (and, on a tick, the pieces held) as one record
        a partition."""
        given, self._ready = self._ready, []
        if tick:
            holding, self._holding = self._holding, {}
            for pieces in holding.values():
                taken = pieces.take()
                if taken is not None:
                    given.append(taken)
        by_partition: dict[int, list[_Given]] = {}
        for item in given:
            by_partition.setdefault(item[1], []).append(item)
        room = self.settings.kafka.max_event_bytes - RECORD_MARGIN
        for partition, items in by_partition.items():
            for group in _within(items, room):
                out = batch_output(self.settings.kafka, TOKENS, [c for c, _, _ in group],
                                   partition)
                await self._send(out, [d for _, _, d in group])

    async def _send(self, out: Output, done: list[asyncio.Future[None]]) -> None:
        try:
            ack = await self.sender.send_nowait(out)
        except Exception as exc:
            _settle(done, None, exc)
            return
        self.records += 1

        def settled(fut: asyncio.Future[Any]) -> None:
            exc = None if fut.cancelled() else fut.exception()
            _settle(done, fut if fut.cancelled() else None, exc)

        ack.add_done_callback(settled)


def _within(items: list[_Given], room: int) -> list[list[_Given]]:
    """``items`` in order, in groups that fit one record (only embeddings'
    vectors are large; the gateway keeps one request's within a record)."""
    groups: list[list[_Given]] = [[]]
    size = 0
    for item in items:
        bytes_ = event_bytes(item[0])
        if groups[-1] and size + bytes_ > room:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += bytes_
    return groups


def _settle(done: list[asyncio.Future[None]], cancelled: Any,
            exc: BaseException | None) -> None:
    for fut in done:
        if fut.done():
            continue
        if cancelled is not None:
            fut.cancel()
        elif exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(None)
