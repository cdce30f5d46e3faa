"""``POST /v1/messages``, Anthropic's Messages API: it only dispatches to
:class:`~gateway.messages.serving.MessagesServing`. The body is read here and
validated by gateway/messages/protocol.py, so a refusal names the field as
Anthropic does; ``anthropic-version`` and ``anthropic-beta`` are accepted,
and their absence too."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.messages.protocol import parse_request
from gateway.messages.serving import MessagesServing
from gateway.services import service

__all__ = ["messages_router"]

messages_router = APIRouter()

Messages = Annotated[MessagesServing, Depends(service("messages"))]


@messages_router.post("/v1/messages", response_model=None)
async def create_message(request: Request, messages: Messages) -> Response:
    """A Message (``stream: true``: its events), in Anthropic's shapes."""
    return await messages.create(parse_request(await request.body()), request)
