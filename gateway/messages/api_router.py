"""``POST /v1/messages``, Anthropic's Messages API: it only dispatches to
:class:`~gateway.messages.serving.MessagesServing`. The body is read here and
validated by gateway/messages/protocol.py, so a refusal names the field as
Anthropic does; ``anthropic-version`` and ``anthropic-beta`` are accepted,
and their absence too."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.messages.protocol import MessagesRequest, parse_request
from gateway.messages.serving import MessagesServing
from gateway.openapi import request_schema
from gateway.services import service

__all__ = ["messages_router"]

messages_router = APIRouter()

Messages = Annotated[MessagesServing, Depends(service("messages"))]


def _openapi() -> tuple[dict[str, Any], dict[int | str, dict[str, Any]]]:
    """The route's request body and responses as the OpenAPI document shows them."""
    body = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": request_schema(MessagesRequest)}}}}
    error = {"content": {"application/json": {"schema": {
        "type": "object", "required": ["type", "error"], "properties": {
            "type": {"const": "error"}, "request_id": {"type": "string"},
            "error": {"type": "object", "required": ["type", "message"], "properties": {
                "type": {"type": "string"}, "message": {"type": "string"}}}}}}}}
    responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "A Message, or with stream: true its server-sent events "
                             "(message_start, content_block_start, ping, "
                             "content_block_delta..., content_block_stop, message_delta, "
                             "message_stop; an error event after a failure)",
              "content": {"application/json": {"schema": {"type": "object"}},
                          "text/event-stream": {"schema": {"type": "string"}}}},
        **{status: {**error, "description": kind} for status, kind in (
            (400, "invalid_request_error"), (401, "authentication_error"),
            (403, "permission_error"), (404, "not_found_error"),
            (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
            (504, "timeout_error"), (529, "overloaded_error"))}}
    return body, responses


_BODY, _RESPONSES = _openapi()


@messages_router.post("/v1/messages", response_model=None, openapi_extra=_BODY,
                      responses=_RESPONSES)
async def create_message(request: Request, messages: Messages) -> Response:
    """A Message (``stream: true``: its events), in Anthropic's shapes (docs/api/messages.md)."""
    return await messages.create(parse_request(await request.body()), request)
