"""Resuming an SSE stream (docs/api/streams.md) on any replica. Data events carry
``id: {request id}:{seq}``, ``seq`` counting data events from 0, a pure function
of the replies. The request event (found near when its id was made, then in
recent windows) gives the tenant, deadline and reply partition;
:class:`RecordedReplies` reads that partition from the request's time, the
recorded replies then the live ones. A resumed stream holds the watch key."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

from conveyor.errors import (
    BrokerError,
    InvalidRequest,
    PipelineUnavailable,
)
from conveyor.settings import Settings
from gateway.cancels import Cancels
from gateway.errors import NotFound
from gateway.replies import ReplyStream, reply_error
from schemas.codec import Codec
from schemas.records import Generation, Reply
from topics.catalog import REPLIES, REQUESTS
from topics.envelope import now_ms
from topics.follow import FromTime, follow
from topics.lookup import SharedLookup, made_window
from topics.reader import holds

__all__ = ["Recorded", "RecordedReplies", "StreamNotFound",
           "Framer", "event_id", "request_id_of", "resume_after", "locate", "lookup_windows",
           "resumed_events"]

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion", "embedding"]

# the id prefix the stream's chunk objects carry (schemas/openai/chunks.py)
_PREFIXES: dict[Kind, str] = {"chat": "chatcmpl-", "completion": "cmpl-"}
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
# a resume is nearly always seconds after the drop: look there first, then back
# as far as the longest deadline a request may have (X-Conveyor-Timeout, 3600 s)
_LOOKUP_WINDOWS_S = (120, 3600)


class StreamNotFound(NotFound):
    """404 for a stream that does not exist, or is not the caller's to see."""

    def __init__(self, stream_id: str) -> None:
        super().__init__(f"No stream {stream_id!r} was found.", param="id")


def event_id(request_id: str, seq: int) -> str:
    return f"{request_id}:{seq}"


def request_id_of(stream_id: str, kind: Kind | None = None) -> str:
    """The request id a stream id names: the chunks' ``id`` (``chatcmpl-...`` on
    the chat route, ``cmpl-...`` on completions; either without ``kind``) or the
    bare request id."""
    rid = stream_id
    for other, prefix in _PREFIXES.items():
        if stream_id.startswith(prefix):
            if kind is not None and other != kind:
                raise StreamNotFound(stream_id)
            rid = stream_id[len(prefix):]
    if not _REQUEST_ID.match(rid):
        raise StreamNotFound(stream_id)
    return rid


def resume_after(request_id: str, last_event_id: str | None,
                 starting_after: str | None) -> int:
    """The last event the client has (-1: none, send the whole stream).
    ``Last-Event-ID`` wins over ``?starting_after``: a browser's EventSource
    reconnects to the same URL with a newer header each time."""
    if last_event_id is not None and last_event_id.strip():
        raw, param = last_event_id.strip(), "Last-Event-ID"
        rid, sep, seq = raw.rpartition(":")
        if sep and rid != request_id:
            raise InvalidRequest(f"Last-Event-ID {raw!r} names another stream.", param=param)
        raw = seq
    elif starting_after is not None:
        raw, param = starting_after.strip(), "starting_after"
    else:
        return -1
    if not raw.isdigit():
        raise InvalidRequest(f"{param} must be an event id ({{request id}}:N) or N >= 0.",
                             param=param)
    return int(raw)


@dataclass(frozen=True)
class Recorded:
    """Where a request's replies are, from its ``conveyor.requests`` event."""

    request_id: str
    tenant: str
    kind: Kind
    reply_partition: int
    submitted_ms: int  # the request event's record time
    deadline_ms: int
    # what was asked: the Responses API rebuilds its response objects from it
    generation: Generation


async def locate(lookup: SharedLookup, request_id: str, *, timeout_s: float = 10.0,
                 of_job: bool = False, since_ms: int | None = None) -> Recorded | None:
    """The request's recorded address, or None when no such request is in the log
    (a job's, whose answer is not a stream, only ``of_job``: then only a job's);
    written at ``since_ms`` or later when that is known (a job's request id says
    no time), else looked for in :func:`lookup_windows`; 503 when Kafka cannot
    say within ``timeout_s`` (each window's read is bounded by it)."""
    windows = lookup_windows(lookup.settings, request_id, now_ms()) if since_ms is None \
        else [(since_ms - lookup.settings.process.clock_skew_ms, None)]
    for since, until in windows:
        try:
            found = await lookup.find(REQUESTS, request_id, since, until, timeout_s=timeout_s)
        except BrokerError as exc:
            raise PipelineUnavailable(f"The pipeline is unavailable ({exc}); "
                                      "try again later.") from exc
        for record, request in found:
            envelope = request["envelope"]
            if envelope["request_id"] != request_id or bool(envelope.get("job_id")) != of_job:
                continue
            return Recorded(request_id=request_id, tenant=envelope["tenant"],
                            kind=request["generation"]["kind"],
                            reply_partition=envelope["reply_partition"],
                            submitted_ms=record.timestamp,
                            deadline_ms=envelope["deadline_ms"],
                            generation=request["generation"])
    return None


def lookup_windows(settings: Settings, request_id: str, now: int) -> list[tuple[int, int | None]]:
    """Where to look for the request event, as (since, until) record times: at
    the time its id was made (ids from topics.envelope.new_request_id), then
    the recent windows."""
    skew = settings.process.clock_skew_ms
    windows: list[tuple[int, int | None]] = []
    made = made_window(request_id, skew, now)
    if made is not None:
        windows.append(made)
    windows += [(now - window_s * 1000 - skew, None) for window_s in _LOOKUP_WINDOWS_S]
    return windows


class RecordedReplies:
    """A request's replies read from its reply partition, in index order: what is
    recorded, then the live rest. ``next`` behaves as the live answer's does."""

    def __init__(self, settings: Settings, codec: Codec, where: Recorded) -> None:
        self.settings = settings
        self.codec = codec
        self.where = where
        self.stream = ReplyStream(where.request_id)
        self.finished = False
        self._last: int | None = None  # the index of the final (or error) reply
        self.ended_ms: int | None = None  # the record time of the final (or error) reply
        deadline_ms = where.deadline_ms or (
            where.submitted_ms + int(settings.gateway.request_timeout_s * 1000))
        left_s = (deadline_ms + settings.process.clock_skew_ms - now_ms()) / 1000
        self.deadline = time.monotonic() + left_s
        self._pump: asyncio.Task[None] | None = None

    @property
    def request_id(self) -> str:
        return self.where.request_id

    def start(self) -> None:
        self._pump = asyncio.create_task(self._read(), name=f"resume-{self.request_id}")

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump

    async def _read(self) -> None:
        where = self.where
        key = where.request_id.encode()
        follower = follow(self.settings, REPLIES, where.reply_partition,
                          FromTime(where.submitted_ms - self.settings.process.clock_skew_ms))
        async for batch in follower.events(self.codec, keep=lambda r: holds(r, key)):
            for record, reply in batch:
                if reply["envelope"]["request_id"] != where.request_id:
                    continue  # another request's, in the same record
                if reply["kind"] in ("final", "error"):
                    self._last = reply["index"]
                    self.ended_ms = record.timestamp
                self.stream.put(reply)
            if self._last is not None and self.stream.next_index > self._last:
                return  # every reply up to the last is handed over

    async def next(self, within: float | None = None) -> Reply | None:
        """The next reply; None when ``within`` passed first; 504 past the deadline
        (a recorded reply is always given first, however late the resume)."""
        reply = await self.stream.next(self.deadline, within)
        if reply is None:
            return None
        if reply["kind"] in ("final", "error"):
            self.finished = True
        if reply["kind"] == "error":
            raise reply_error(reply)
        return reply


#: how a resumed stream is written: its SSE frames from the recorded replies,
#: those after event ``after`` sent
Framer = Callable[[RecordedReplies, int], AsyncIterator[bytes]]


async def resumed_events(settings: Settings, codec: Codec, cancels: Cancels, where: Recorded,
                         after: int, framer: Framer) -> AsyncIterator[bytes]:
    """The SSE events of a recorded stream after event ``after`` (-1: all), framed by
    ``framer``, holding the request's watch; a client leaving gets the usual grace."""
    replies = RecordedReplies(settings, codec, where)
    rid = where.request_id
    reader = uuid.uuid4().hex
    watch = cancels.watch
    try:
        await watch.renew(rid, reader)
    except Exception as exc:  # the stream is still served; the keeper retries
        log.warning("resume %s: naming its reader failed: %r", rid, exc)
    keeper = asyncio.create_task(watch.keep(rid, reader), name=f"watch-{rid}")
    replies.start()
    ended = False
    try:
        async for frame in framer(replies, after):
            yield frame
        ended = True
    finally:
        keeper.cancel()
        await replies.close()
        if ended or replies.finished:
            with contextlib.suppress(Exception):
                await watch.detach(rid, reader)
        else:
            cancels.cancel(rid, "resumed client disconnected",
                           grace_s=settings.gateway.resume_grace_s, reader=reader)
