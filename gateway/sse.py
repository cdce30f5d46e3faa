"""Server-sent events framing: the only place that knows the wire format."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from schemas.openai.chunks import compact_json

__all__ = ["DONE", "HEADERS", "EventStream", "Last", "comment", "data", "json_data"]

DONE = b"data: [DONE]\n\n"
# what every event stream is sent with: no cache, and no proxy buffering it
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Last(bytes):
    """A stream's last frame: :class:`EventStream` sends it with the end of the
    response, in one write."""


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response sending its :class:`Last` frame with the end
    of the body in one write (docs/decisions/0015-fewer-writes-at-the-gateway.md)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream; a client that leaves closes the iterator at once. Below ASGI 2.4 a
        task watches ``receive`` for that; from 2.4 starlette does."""
        spec = scope.get("asgi", {}).get("spec_version", "2.0")
        if scope["type"] != "http" or tuple(map(int, spec.split("."))) >= (2, 4):
            await super().__call__(scope, receive, send)
            return
        streaming = asyncio.current_task()
        assert streaming is not None
        ended = left = False

        async def watch() -> None:
            nonlocal left
            with contextlib.suppress(Exception):  # a server's failure here ends only the watch
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not ended:
                    left = True
                    streaming.cancel()

        watcher = asyncio.create_task(watch(), name="sse-disconnect")
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not left or streaming.uncancel() > 0:  # cancelled from elsewhere too
                raise
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:  # it may wait in a send, not in the iterator
                with contextlib.suppress(Exception):
                    await aclose()
        finally:
            ended = True
            watcher.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        last = b""
        async for chunk in self.body_iterator:
            if last:  # a frame after the last one: sent as it is
                await send({"type": "http.response.body", "body": last, "more_body": True})
                last = b""
            body = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset)
            if isinstance(chunk, Last):
                last = bytes(body)  # the iterator ends now: its end is awaited first
                continue
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": last, "more_body": False})


def data(payload: str, event: str | None = None, id: str | None = None) -> bytes:
    """One event, named by ``event``, with ``id`` (a client's ``Last-Event-ID``);
    text UTF-8 cannot hold is sent as "?"."""
    named = b"event: " + event.encode() + b"\n" if event else b""
    if id is not None:
        named += b"id: " + id.encode() + b"\n"
    return named + b"data: " + payload.encode("utf-8", "replace") + b"\n\n"


def json_data(obj: Any, event: str | None = None, id: str | None = None) -> bytes:
    """One event whose data is ``obj`` as compact JSON."""
    return data(compact_json(obj), event, id)


def comment(text: str = "keep-alive") -> bytes:
    """A comment line, with no blank line after it: a blank line ends an event, and
    the official ``openai`` client, which keeps the last event id, reads one after
    an id'd event as an event with empty data (and fails to parse it)."""
    return b": " + text.encode() + b"\n"
