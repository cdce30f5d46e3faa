"""The WebSocket messages (docs/api/websocket.md), close codes and framing:
``request``/``cancel`` in, ``chunk``/``done``/``error`` out (one ``done`` or
``error`` per id), or ``response.create`` in Responses mode. A frame that is
none of these closes the connection; a bad body fails its request alone.

:class:`Connection` is the only user of an accepted ASGI WebSocket: its
:class:`ConnectionState` transitions are checked, so nothing is sent after the
close and it is sent once; a lock keeps concurrent messages whole and in
order, and a send to a gone client is dropped, never raised."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from starlette.websockets import WebSocket, WebSocketDisconnect

from conveyor.errors import RequestError
from gateway.errors import safe_json

__all__ = ["Endpoint", "UNSUPPORTED_DATA", "INVALID_PAYLOAD", "POLICY_VIOLATION", "MESSAGE_TOO_BIG",
           "INTERNAL_ERROR", "TRY_AGAIN_LATER", "MAX_ID_CHARS", "FrameError", "RequestMessage",
           "CancelMessage", "ResponseCreate", "parse_multiplexed", "parse_response_create",
           "close_reason", "encode", "chunk_frame", "done_message", "error_message",
           "response_error_event", "close_code_of", "ConnectionState", "Connection"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# RFC 6455 section 7.4.1 and the IANA registry
UNSUPPORTED_DATA = 1003  # a binary frame: this protocol is text
INVALID_PAYLOAD = 1007  # text, but not a message of this protocol
POLICY_VIOLATION = 1008  # refused by authentication
MESSAGE_TOO_BIG = 1009
INTERNAL_ERROR = 1011
TRY_AGAIN_LATER = 1013  # the gateway (or Redis behind it) cannot identify callers now

MAX_ID_CHARS = 256

Endpoint = Literal["chat", "completion"]
_MAX_REASON_BYTES = 123  # a close frame's payload is at most 125 bytes, 2 of them the code


class FrameError(Exception):
    """A frame the protocol cannot take: the connection closes with ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class RequestMessage:
    id: str
    body: Any  # validated by the request's own task: a bad body is an error for its id


@dataclass(frozen=True)
class CancelMessage:
    id: str


@dataclass(frozen=True)
class ResponseCreate:
    fields: dict[str, Any]  # a POST /v1/responses body, ``stream`` set


def _object(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError:
        raise FrameError(INVALID_PAYLOAD, "the message is not JSON") from None
    except RecursionError:
        raise FrameError(INVALID_PAYLOAD, "the message is nested too deeply") from None
    if not isinstance(data, dict):
        raise FrameError(INVALID_PAYLOAD, "the message must be a JSON object")
    return data


def parse_multiplexed(text: str) -> RequestMessage | CancelMessage:
    """A client message of the multiplexed endpoints; :class:`FrameError` otherwise."""
    data = _object(text)
    kind = data.get("type")
    if kind not in ("request", "cancel"):
        raise FrameError(INVALID_PAYLOAD, "unknown message type: expected 'request' or "
                                          "'cancel'")
    rid = data.get("id")
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_CHARS:
        raise FrameError(INVALID_PAYLOAD, f"a {kind} needs an 'id': a string of 1 to "
                                          f"{MAX_ID_CHARS} characters")
    if kind == "cancel":
        return CancelMessage(rid)
    return RequestMessage(rid, data.get("body"))


def parse_response_create(text: str) -> ResponseCreate:
    """A ``response.create`` event; :class:`FrameError` for any other frame."""
    data = _object(text)
    if data.get("type") != "response.create":
        raise FrameError(INVALID_PAYLOAD, "unknown event type: expected 'response.create'")
    nested = data.get("response")
    fields = dict(nested) if isinstance(nested, dict) else {
        k: v for k, v in data.items() if k not in ("type", "stream_id")}
    fields["stream"] = True
    return ResponseCreate(fields)


def close_reason(text: str) -> str:
    """``text`` cut to what a close frame holds (123 bytes of UTF-8)."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= _MAX_REASON_BYTES:
        return raw.decode("utf-8")
    return raw[:_MAX_REASON_BYTES - 3].decode("utf-8", "ignore") + "..."


def close_code_of(exc: RequestError) -> int:
    """The close code of a refusal at the handshake: 1013 when the gateway cannot
    check now (503: starting, Redis unreachable), else 1008."""
    return TRY_AGAIN_LATER if exc.status == 503 else POLICY_VIOLATION


def encode(message: dict[str, Any]) -> str:
    """A message as one text frame (:func:`gateway.errors.safe_json`)."""
    return safe_json(message).decode()


def chunk_frame(rid: str, chunk_json: str) -> str:
    """A ``chunk`` message around one chunk object as the pipeline wrote it (one
    line of ``Reply.chunk``): spliced, not parsed and written again."""
    return '{"type":"chunk","id":' + json.dumps(rid) + ',"data":' + chunk_json + "}"


def done_message(rid: str) -> dict[str, Any]:
    return {"type": "done", "id": rid}


def error_message(rid: str, exc: RequestError) -> dict[str, Any]:
    return {"type": "error", "id": rid, "status": exc.status, **exc.envelope()}


def response_error_event(exc: RequestError) -> dict[str, Any]:
    """OpenAI's ``error`` event of the Responses stream, with the HTTP status the
    same refusal has over HTTP."""
    return {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param,
            "status": exc.status, "sequence_number": 0}


class ConnectionState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"  # the server's close is being sent
    CLOSED = "closed"


_ALLOWED = {
    ConnectionState.OPEN: {ConnectionState.CLOSING, ConnectionState.CLOSED},
    ConnectionState.CLOSING: {ConnectionState.CLOSED},
    ConnectionState.CLOSED: set(),
}


class Connection:
    def __init__(self, websocket: WebSocket, max_frame_bytes: int) -> None:
        self.websocket = websocket
        self.max_frame_bytes = max_frame_bytes
        self.state = ConnectionState.OPEN
        self._lock = asyncio.Lock()

    def _move(self, to: ConnectionState) -> None:
        if to not in _ALLOWED[self.state]:
            raise RuntimeError(f"WebSocket cannot go from {self.state.value} to {to.value}")
        self.state = to

    @property
    def open(self) -> bool:
        return self.state is ConnectionState.OPEN

    async def receive(self) -> str | None:
        """The next text frame; None once the client has gone (or the server
        closed). A binary frame or one over ``max_frame_bytes`` is a
        :class:`FrameError`."""
        if not self.open:
            return None
        message = await self.websocket.receive()
        if message["type"] == "websocket.disconnect":
            if self.state is not ConnectionState.CLOSED:
                self._move(ConnectionState.CLOSED)
            return None
        text = message.get("text")
        if text is None:
            raise FrameError(UNSUPPORTED_DATA, "binary frames are not taken: send JSON text")
        if len(text) > self.max_frame_bytes:
            raise FrameError(MESSAGE_TOO_BIG, f"a message may be at most "
                                              f"{self.max_frame_bytes} bytes")
        return str(text)

    async def next_message(self, parse: Callable[[str], T]) -> T | None:
        """The next frame as ``parse`` reads it; None once the client has gone,
        or after a frame the protocol cannot take closed the connection (with
        that frame's close code and reason)."""
        try:
            text = await self.receive()
            return None if text is None else parse(text)
        except FrameError as exc:
            await self.close(exc.code, exc.reason)
            return None

    async def send(self, text: str) -> bool:
        """Send one text frame; False when it was dropped (the connection is not open)."""
        async with self._lock:
            if not self.open:
                return False
            try:
                await self.websocket.send_text(text)
            except (WebSocketDisconnect, RuntimeError, OSError):
                if self.state is not ConnectionState.CLOSED:
                    self._move(ConnectionState.CLOSED)
                return False
            return True

    async def close(self, code: int, reason: str) -> None:
        """Close with ``code`` and ``reason`` (cut to what a close frame holds); a
        second close, or one after the client left, does nothing."""
        async with self._lock:
            if not self.open:
                return
            self._move(ConnectionState.CLOSING)
            try:
                await self.websocket.close(code, close_reason(reason))
            except (WebSocketDisconnect, RuntimeError, OSError) as exc:
                log.debug("close %d not sent: %r", code, exc)
            self._move(ConnectionState.CLOSED)
