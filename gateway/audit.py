"""``conveyor.audit``: a record of who changed keys and limits, and who was refused.

Events never hold a secret: a key is named by its id, or by the first 12
hex digits of its keyed hash when it is unknown. The gateway's audit events
(refusals, on a request's path) go through its publisher fire-and-forget
(:meth:`~gateway.publisher.Publisher.publish_soon`): writing one never fails
or slows the request that caused it, and a broker that cannot take it costs a
rate-limited warning line (why not a send that must arrive: see
gateway/publisher.py). The CLI waits for its events (:meth:`Audit.write`).
"""

from __future__ import annotations

import socket
from typing import Any

from conveyor.settings import Settings
from gateway.publisher import Publisher
from schemas.codec import Codec, default_codec
from schemas.records import AuditEvent
from topics.catalog import AUDIT
from topics.envelope import now_ms
from topics.producer import EventProducer

__all__ = ["Audit", "audit_event", "cli_actor"]

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

    def __init__(self, settings: Settings, publisher: Publisher | EventProducer,
                 codec: Codec | None = None, actor: str = "") -> None:
        self.publisher = publisher if isinstance(publisher, Publisher) else Publisher(
            settings, publisher, codec or default_codec())
        self.actor = actor

    async def write(self, event: AuditEvent) -> None:
        """Produce and wait for the broker (the CLI, which must not exit first);
        raises :class:`~conveyor.errors.PipelineUnavailable` when Kafka does not
        take it within ``produce_timeout_s``."""
        await self.publisher.publish(AUDIT, event, self._keyed(event),
                                     what=f"the audit event {event['action']}")

    def record(self, action: str, **fields: Any) -> None:
        """Produce in the background (the gateway, on a request's path)."""
        event = audit_event(action, **fields)
        self.publisher.publish_soon(AUDIT, event, self._keyed(event),
                                    what=f"the audit event {action}")

    def _keyed(self, event: AuditEvent) -> str:
        """The event's Kafka key (its tenant, else its actor), its actor filled in."""
        if not event["actor"]:
            event["actor"] = self.actor
        return event["tenant"] or event["actor"] or "-"
