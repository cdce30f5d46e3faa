"""The WebSocket routes. They accept the connection and only dispatch.

``/v1/chat/completions`` and ``/v1/completions`` multiplex generations
(:mod:`gateway.websocket.chat`); ``/v1/responses`` is OpenAI's Responses
WebSocket mode (:mod:`gateway.websocket.responses`). The paths are those of
the HTTP routes: a WebSocket handshake and a POST never meet on one route.
Authentication ran before the handshake was accepted
(:class:`gateway.auth.middleware.AuthMiddleware`); limits apply per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, WebSocket
from starlette.requests import HTTPConnection

from gateway.provide import services_of
from gateway.submission import Submitter
from gateway.websocket.chat import Multiplexer
from gateway.websocket.connection import Connection
from gateway.websocket.responses import ResponsesSession

__all__ = ["websocket_router"]

websocket_router = APIRouter()


def _submitter(connection: HTTPConnection) -> Submitter:
    submitter: Submitter = services_of(connection).submitter
    return submitter


def _max_bytes(connection: HTTPConnection) -> int:
    """The largest message a connection takes: the HTTP body limit."""
    max_bytes: int = services_of(connection).settings.gateway.max_body_bytes
    return max_bytes


async def _open(websocket: WebSocket, max_bytes: int) -> Connection:
    await websocket.accept()
    return Connection(websocket, max_bytes)


@websocket_router.websocket("/v1/chat/completions")
async def chat_completions_ws(websocket: WebSocket,
                              submitter: Annotated[Submitter, Depends(_submitter)],
                              max_bytes: Annotated[int, Depends(_max_bytes)]) -> None:
    connection = await _open(websocket, max_bytes)
    await Multiplexer(connection, submitter, websocket, "chat").run()


@websocket_router.websocket("/v1/completions")
async def completions_ws(websocket: WebSocket, submitter: Annotated[Submitter, Depends(_submitter)],
                         max_bytes: Annotated[int, Depends(_max_bytes)]) -> None:
    connection = await _open(websocket, max_bytes)
    await Multiplexer(connection, submitter, websocket, "completion").run()


@websocket_router.websocket("/v1/responses")
async def responses_ws(websocket: WebSocket, submitter: Annotated[Submitter, Depends(_submitter)],
                       max_bytes: Annotated[int, Depends(_max_bytes)]) -> None:
    connection = await _open(websocket, max_bytes)
    await ResponsesSession(connection, submitter, websocket).run()
