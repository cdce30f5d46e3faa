"""The WebSocket routes, on the HTTP routes' paths: multiplexed chat and
completions, and the Responses WebSocket mode. They accept and only dispatch;
authentication ran before the handshake, limits apply per request."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, WebSocket

from gateway.responses.serving import ResponsesServing
from gateway.services import service, services_of
from gateway.submission import Submitter
from gateway.websocket.chat import Multiplexer
from gateway.websocket.protocol import Connection
from gateway.websocket.responses import ResponsesSession

__all__ = ["websocket_router"]

websocket_router = APIRouter()

Submitting = Annotated[Submitter, Depends(service("submitter"))]
Responding = Annotated[ResponsesServing, Depends(service("responses"))]


async def _accepted(websocket: WebSocket) -> Connection:
    """The connection, accepted; its largest message is the HTTP body limit."""
    max_bytes: int = services_of(websocket).settings.gateway.max_body_bytes
    await websocket.accept()
    return Connection(websocket, max_bytes)


Accepted = Annotated[Connection, Depends(_accepted)]


@websocket_router.websocket("/v1/chat/completions")
async def chat_completions_ws(websocket: WebSocket, submitter: Submitting,
                              connection: Accepted) -> None:
    await Multiplexer(connection, submitter, websocket, "chat").run()


@websocket_router.websocket("/v1/completions")
async def completions_ws(websocket: WebSocket, submitter: Submitting,
                         connection: Accepted) -> None:
    await Multiplexer(connection, submitter, websocket, "completion").run()


@websocket_router.websocket("/v1/responses")
async def responses_ws(websocket: WebSocket, responses: Responding,
                       connection: Accepted) -> None:
    await ResponsesSession(connection, responses, websocket).run()
