"""The WebSocket routes. They accept the connection and only dispatch.

``/v1/chat/completions`` and ``/v1/completions`` multiplex generations
(:mod:`gateway.websocket.chat`); ``/v1/responses`` is OpenAI's Responses
WebSocket mode (:mod:`gateway.websocket.responses`). The paths are those of
the HTTP routes: a WebSocket handshake and a POST never meet on one route.
Authentication ran before the handshake was accepted
(:class:`gateway.auth.middleware.AuthMiddleware`); limits apply per request.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from gateway.serving import Serving
from gateway.websocket.chat import Multiplexer
from gateway.websocket.connection import Connection
from gateway.websocket.protocol import Endpoint
from gateway.websocket.responses import ResponsesSession

__all__ = ["websocket_router"]

websocket_router = APIRouter()


async def _open(websocket: WebSocket) -> tuple[Connection, Serving]:
    await websocket.accept()
    serving: Serving = websocket.app.state.serving
    return Connection(websocket, serving.settings.max_body_bytes), serving


async def _multiplex(websocket: WebSocket, endpoint: Endpoint) -> None:
    connection, serving = await _open(websocket)
    await Multiplexer(connection, serving, websocket, endpoint).run()


@websocket_router.websocket("/v1/chat/completions")
async def chat_completions_ws(websocket: WebSocket) -> None:
    await _multiplex(websocket, "chat")


@websocket_router.websocket("/v1/completions")
async def completions_ws(websocket: WebSocket) -> None:
    await _multiplex(websocket, "completion")


@websocket_router.websocket("/v1/responses")
async def responses_ws(websocket: WebSocket) -> None:
    connection, serving = await _open(websocket)
    await ResponsesSession(connection, serving, websocket).run()
