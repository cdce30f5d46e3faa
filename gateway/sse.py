"""Server-sent events framing: the only place that knows the wire format."""

from __future__ import annotations

__all__ = ["data", "comment", "DONE"]

DONE = b"data: [DONE]\n\n"


def data(payload: str, event: str | None = None, id: str | None = None) -> bytes:
    """One event (named by ``event`` when given, as the Responses API's are;
    ``id`` is what a reconnecting client sends back as ``Last-Event-ID``).
    Text UTF-8 cannot hold (a lone surrogate) is sent as "?" rather than failing
    mid-stream."""
    named = b"event: " + event.encode() + b"\n" if event else b""
    if id is not None:
        named += b"id: " + id.encode() + b"\n"
    return named + b"data: " + payload.encode("utf-8", "replace") + b"\n\n"


def comment(text: str = "keep-alive") -> bytes:
    return b": " + text.encode() + b"\n\n"
