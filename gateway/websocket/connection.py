"""One accepted WebSocket: frames in, messages out, one close. Its
:class:`ConnectionState` transitions are checked, so nothing is sent after
the close and it is sent once; a lock keeps concurrent messages whole and in
order, and a send to a gone client is dropped, never raised."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import TypeVar

from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.websocket.protocol import (
    MESSAGE_TOO_BIG,
    UNSUPPORTED_DATA,
    FrameError,
    close_reason,
)

__all__ = ["ConnectionState", "Connection"]

T = TypeVar("T")

log = logging.getLogger(__name__)


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
