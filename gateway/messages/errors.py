"""Anthropic's error shape on ``/v1/messages``: an ASGI middleware, outside the
gateway's own, that rewrites every error response there (authentication,
body limits, validation, admission, the pipeline's failures, the last-resort
500) from OpenAI's envelope into ``{"type": "error", "error": {"type",
"message"}}`` with Anthropic's status for its kind (a 503 is ``overloaded_error``
529, as Anthropic sends it). Everything else passes untouched."""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import safe_json
from gateway.messages.objects import error_of

__all__ = ["AnthropicErrors", "PATH"]

PATH = "/v1/messages"


class AnthropicErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or not (path == PATH or path.startswith(PATH + "/")):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewriting_send(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start":
                if message["status"] < 400:
                    await send(message)
                    return
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            headers = MutableHeaders(raw=list(start["headers"]))
            status, rewritten = anthropic_error(start["status"], body,
                                                headers.get("x-request-id"))
            headers["content-length"] = str(len(rewritten))
            headers["content-type"] = "application/json"
            if "x-request-id" in headers:
                headers["request-id"] = headers["x-request-id"]
            await send({**start, "status": status, "headers": headers.raw})
            await send({"type": "http.response.body", "body": rewritten, "more_body": False})

        await self.app(scope, receive, rewriting_send)


def anthropic_error(status: int, body: bytes,
                    request_id: str | None = None) -> tuple[int, bytes]:
    """An error response's status and body as Anthropic's (a body already in its
    shape is kept)."""
    message, param = f"HTTP {status}", None
    try:
        data: Any = json.loads(body) if body else None
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("type") == "error":
        return status, body
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        error = data["error"]
        message = str(error.get("message") or message)
        param = str(error["param"]) if error.get("param") else None
    elif isinstance(data, dict) and isinstance(data.get("detail"), str):
        message = data["detail"]
    sent, rewritten = error_of(status, message, param, request_id)
    return sent, safe_json(rewritten)
