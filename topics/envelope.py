"""The event envelope: request id, tenant, trace context, per-layer stamps,
attempt and reply address. Every pipeline event carries one."""

from __future__ import annotations

import datetime as dt
import os
import time

from schemas.records import Envelope

__all__ = ["iso", "PRIORITY_INTERACTIVE", "PRIORITY_BACKGROUND", "PRIORITY_BATCH", "canary_key",
           "new_envelope", "new_request_id", "request_time_ms", "new_traceparent", "stamp",
           "now_ms", "now_us", "unstamped"]


# envelope.priority: lower is sooner (schedule admits in this order)
PRIORITY_INTERACTIVE = 0
PRIORITY_BACKGROUND = 1
PRIORITY_BATCH = 2


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def iso(ms: int, timespec: str = "seconds") -> str:
    """Epoch milliseconds as an ISO 8601 UTC time (``+00:00``)."""
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).isoformat(timespec=timespec)


def now_us() -> int:
    return time.time_ns() // 1_000


def new_request_id() -> str:
    """32 hex digits, the first 12 the creation time in epoch milliseconds and the
    rest random (80 bits): unique, and the log can be searched for the request
    at that moment instead of over a window (:func:`request_time_ms`)."""
    return f"{now_ms() & 0xFFFF_FFFF_FFFF:012x}{os.urandom(10).hex()}"


def request_time_ms(request_id: str) -> int | None:
    """When a request id from :func:`new_request_id` was made; None for any other
    id (a random one reads as a time thousands of years away: callers check
    that the time is plausible before trusting it)."""
    if len(request_id) != 32:
        return None
    try:
        return int(request_id[:12], 16)
    except ValueError:
        return None


def new_traceparent() -> str:
    """A fresh W3C ``traceparent`` (version 00, sampled)."""
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"


def new_envelope(
    request_id: str,
    *,
    reply_gateway: str,
    reply_partition: int,
    tenant: str = "default",
    key_id: str = "",
    job_id: str = "",
    job_item: str = "",
    traceparent: str | None = None,
    deadline_ms: int = 0,
    priority: int = 0,
) -> Envelope:
    return Envelope(
        request_id=request_id,
        tenant=tenant,
        key_id=key_id,
        job_id=job_id,
        job_item=job_item,
        traceparent=traceparent or new_traceparent(),
        attempt=0,
        reply_gateway=reply_gateway,
        reply_partition=reply_partition,
        deadline_ms=deadline_ms,
        priority=priority,
        stamps={"gateway": now_us()},
    )


# the tenant of a request without credentials (gateway.auth.types.ANONYMOUS_TENANT)
ANONYMOUS_TENANT = "default"


def canary_key(envelope: Envelope) -> str:
    """What picks a canary's deployment (conveyor/registry.py): the tenant, so that
    a tenant sees one version; a request without credentials on its own (else
    every anonymous request would go to one deployment)."""
    if not envelope["key_id"] and envelope["tenant"] in ("", ANONYMOUS_TENANT):
        return envelope["request_id"]
    return envelope["tenant"] or envelope["key_id"]


def stamp(envelope: Envelope, layer: str) -> Envelope:
    """Record when ``layer`` took the event (the first time only: redelivery keeps it)."""
    envelope["stamps"].setdefault(layer, now_us())
    return envelope


def unstamped(envelope: Envelope) -> Envelope:
    """``envelope`` without its stamps: what a stream's chunks and replies carry
    between its first and its last, which hold the request's journey
    (docs/decisions/0032-many-streams-a-record.md)."""
    return Envelope(**{**envelope, "stamps": {}})  # type: ignore[typeddict-item]
