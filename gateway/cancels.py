"""Cancelling a generation, at once or after a grace in which a resumed stream may
take it over. ``{prefix}:resume-watch:{request id}`` names a resumed stream's
reader (renewed every third of ``reply_lease_ttl_s``); a dropped client's
cancel waits ``resume_grace_s`` and is sent only when no other reader holds
it, and infer workers keep a generation whose gateway is gone while it exists.
A cancel must arrive: it is delivered until the request's deadline."""

from __future__ import annotations

import asyncio
import logging

from conveyor.redis_clients import Redis, release, text
from conveyor.settings import Settings
from gateway.publisher import Publisher
from schemas.records import Control
from topics.catalog import CONTROL
from topics.envelope import now_ms

__all__ = ["Cancels", "ResumeWatch"]

log = logging.getLogger(__name__)


class ResumeWatch:
    """``{prefix}:resume-watch:{request id}``: the reader of a resumed stream
    (see the module). Every call may raise Redis errors; callers decide."""

    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.ttl_ms = int(settings.gateway.reply_lease_ttl_s * 1000)

    def key(self, request_id: str) -> str:
        return f"{self.settings.kafka.topic_prefix}:resume-watch:{request_id}"

    async def renew(self, request_id: str, token: str) -> None:
        """Name ``token`` the request's reader, a new one or again: the last reader
        to renew holds the key, and any reader there keeps it alive."""
        await self.redis.set(self.key(request_id), token, px=self.ttl_ms)

    async def keep(self, request_id: str, token: str) -> None:
        """Renew until cancelled; a Redis error is logged and retried at the pace."""
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                await self.renew(request_id, token)
            except Exception as exc:  # an outage: the next renewal may get through
                log.warning("resume %s: renewing its watch failed: %r", request_id, exc)

    async def detach(self, request_id: str, token: str) -> None:
        """Forget this reader, unless another has taken the key since."""
        await release(self.redis, self.key(request_id), token)

    async def watched_by_another(self, request_id: str, token: str | None = None) -> bool:
        held = await self.redis.get(self.key(request_id))
        return held is not None and text(held) != token


class Cancels:
    """Tells the pipeline to stop requests (``conveyor.control``), through the
    gateway's publisher, asking ``watch`` whether a resumed stream took one over."""

    def __init__(self, settings: Settings, publisher: Publisher, watch: ResumeWatch) -> None:
        self.settings = settings
        self.publisher = publisher
        self.watch = watch
        self._graces: set[asyncio.Task[None]] = set()  # cancels waiting out a grace

    def cancel(self, request_id: str, reason: str, grace_s: float = 0.0,
               reader: str | None = None, deadline_ms: int | None = None) -> None:
        """Stop this request, sent in the background (often from a response being
        cancelled) until ``deadline_ms``; with ``grace_s`` it waits that long and is
        dropped if a resumed stream other than ``reader`` reads the request by then."""
        if grace_s <= 0:
            self._send(request_id, reason, deadline_ms)
            return
        task = asyncio.create_task(
            self._cancel_unless_resumed(request_id, reason, grace_s, reader, deadline_ms))
        self._graces.add(task)
        task.add_done_callback(self._graces.discard)

    async def _cancel_unless_resumed(self, request_id: str, reason: str, grace_s: float,
                                     reader: str | None, deadline_ms: int | None) -> None:
        await asyncio.sleep(grace_s)
        try:
            if await self.watch.watched_by_another(request_id, reader):
                return
            if reader is not None:
                await self.watch.detach(request_id, reader)
        except Exception as exc:  # Redis cannot say: cancel, as without resumption
            log.warning("request %s: whether a resumed stream reads it is unknown (%r); "
                        "cancelling", request_id, exc)
        self._send(request_id, f"{reason} (not resumed within {grace_s:g} s)", deadline_ms)

    def _send(self, request_id: str, reason: str, deadline_ms: int | None) -> None:
        control = Control(request_id=request_id, action="cancel", reason=reason, ts_ms=now_ms())
        self.publisher.deliver(CONTROL, control, request_id, until_ms=deadline_ms,
                               what=f"the cancel of request {request_id}")
