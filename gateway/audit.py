"""``conveyor.audit``: a record of who changed keys and limits, and who was refused.

Events never hold a secret: a key is named by its id, or by the first 12
hex digits of its keyed hash when it is unknown. Writing an audit event never
fails or slows the request that caused it: it is produced in the background,
and a broker that cannot take it costs a (rate-limited) warning line.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from schemas.records import AuditEvent
from topics.catalog import AUDIT
from topics.envelope import now_ms
from topics.producer import Producer

__all__ = ["Audit", "audit_event", "cli_actor"]

log = logging.getLogger(__name__)


def cli_actor() -> str:
    """Who acts from the command line: ``cli@<host>``."""
    return f"cli@{socket.gethostname()}"


def audit_event(action: str, *, tenant: str = "", key_id: str = "", hash_prefix: str = "",
                actor: str = "", reason: str = "", request_id: str = "",
                detail: dict[str, str] | None = None) -> AuditEvent:
    return AuditEvent(ts_ms=now_ms(), action=action, tenant=tenant, key_id=key_id,
                      hash_prefix=hash_prefix, actor=actor, reason=reason,
                      request_id=request_id, detail=dict(detail or {}))


class Audit:
    """Produces audit events on ``conveyor.audit`` (key = tenant, or actor)."""

    def __init__(self, settings: Settings, producer: Producer,
                 codec: Codec | None = None, actor: str = "") -> None:
        self.topic = AUDIT.at(settings)
        self.producer = producer
        self.codec = codec or default_codec()
        self.actor = actor
        self._pending: set[asyncio.Task[Any]] = set()

    async def write(self, event: AuditEvent) -> None:
        """Produce and wait for the broker (the CLI, which must not exit first)."""
        if not event["actor"]:
            event["actor"] = self.actor
        key = (event["tenant"] or event["actor"] or "-").encode()
        await self.producer.send_and_wait(self.topic, self.codec.encode("AuditEvent", event),
                                          key=key)

    def record(self, action: str, **fields: Any) -> None:
        """Produce in the background (the gateway, on a request's path)."""
        task = asyncio.create_task(self._write_quietly(audit_event(action, **fields)))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write_quietly(self, event: AuditEvent) -> None:
        try:
            await self.write(event)
        except Exception as exc:  # the broker is down: the request goes on
            log.warning("audit event %s not written: %r", event["action"], exc)

    async def drain(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
