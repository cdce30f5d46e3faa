"""``conveyor.audit``: a record of who changed keys and limits, and who was refused.

Events never hold a secret: a key is named by its id, or by the first 12 hex
digits of its keyed hash when it is unknown. The gateway's events (refusals,
on a request's path) are fire-and-forget, at most one a period per caller
(:meth:`Audit.record_throttled`), so that writing one never fails or slows a
request; the CLI waits for its events (:meth:`Audit.write`)."""

from __future__ import annotations

import socket
import time
from typing import Any

from conveyor.settings import Settings
from gateway.publisher import Publisher
from schemas.codec import Codec, default_codec
from schemas.records import AuditEvent
from topics.catalog import AUDIT
from topics.envelope import now_ms
from topics.producer import Producer

__all__ = ["Audit", "audit_event", "cli_actor"]

_THROTTLE_MEMORY = 4096  # callers whose last event is remembered


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
    """Produces audit events on ``conveyor.audit`` (key = tenant, or actor)
    through ``publisher``: the gateway's, or one made of a CLI's producer (and
    ``codec``)."""

    def __init__(self, settings: Settings, publisher: Publisher | Producer,
                 codec: Codec | None = None, actor: str = "") -> None:
        self.publisher = publisher if isinstance(publisher, Publisher) else Publisher(
            settings, publisher, codec or default_codec())
        self.actor = actor
        # throttle key -> (last written, events held back since)
        self._throttled: dict[str, tuple[float, int]] = {}

    async def write(self, event: AuditEvent) -> None:
        """Produce and wait for the broker (the CLI, which must not exit first);
        raises :class:`~conveyor.errors.PipelineUnavailable` when Kafka does not
        take it within ``produce_timeout_s``."""
        await self.publisher.publish(AUDIT, event, self._keyed(event),
                                     what=f"the audit event {event['action']}")

    def record_throttled(self, key: str, every_s: float, action: str, **fields: Any) -> None:
        """Produce in the background (the gateway, on a request's path), at most once
        per ``every_s`` for ``key``; the next event counts those held back in
        ``detail["held_back"]`` (a client hammering with a bad key or past its limit
        cannot flood ``conveyor.audit``)."""
        now = time.monotonic()
        last, held = self._throttled.get(key, (0.0, 0))
        if now - last < every_s:
            self._throttled[key] = (last, held + 1)
            return
        if len(self._throttled) >= _THROTTLE_MEMORY:
            self._throttled.clear()
        self._throttled[key] = (now, 0)
        if held:
            fields["detail"] = {**(fields.get("detail") or {}), "held_back": str(held)}
        event = audit_event(action, **fields)
        self.publisher.publish_soon(AUDIT, event, self._keyed(event),
                                    what=f"the audit event {action}")

    def _keyed(self, event: AuditEvent) -> str:
        """The event's Kafka key (its tenant, else its actor), its actor filled in."""
        if not event["actor"]:
            event["actor"] = self.actor
        return event["tenant"] or event["actor"] or "-"
