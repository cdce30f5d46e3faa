"""The request body limit: :class:`BodyLimit` (ASGI) refuses a ``Content-Length``
over ``max_body_bytes`` (or the larger limit ``collected`` gives a path: chat
completions and responses while a model reads images) with 413 before
reading, a chunked body as soon as it passes it, and hands the body on as one
message. Upload paths stream through with their own limit; the read past it
raises :class:`~conveyor.errors.RequestTooLarge` in the route."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.errors import InvalidRequest, RequestTooLarge
from gateway.errors import error_response

__all__ = ["BodyLimit"]


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int,
                 uploads: Mapping[str, int] | None = None,
                 collected: Callable[[str], int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.uploads = dict(uploads or {})
        # the limit of a path's collected body, asked at each request
        self.collected = collected or (lambda path: max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = self._declared_length(scope)
        if declared is None:
            await error_response(InvalidRequest("Content-Length is not a number.",
                                                param="Content-Length"))(scope, receive, send)
            return
        upload_limit = self.uploads.get(scope.get("path", "")) \
            if scope.get("method") == "POST" else None
        collected = self.collected(scope.get("path", "")) \
            if scope.get("method") == "POST" else self.max_bytes
        limit = collected if upload_limit is None else upload_limit
        if declared > limit:
            await error_response(_too_large(declared, limit))(scope, receive, send)
            return
        if upload_limit is not None:
            await self.app(scope, _counted(receive, upload_limit), send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            body += message.get("body", b"")
            if len(body) > collected:
                await error_response(_too_large(None, collected))(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    @staticmethod
    def _declared_length(scope: Scope) -> int | None:
        """The Content-Length (0 when absent), None when it is not a number."""
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                text = value.decode("latin-1").strip()
                return int(text) if text.isdigit() else None
        return 0


def _too_large(declared: int | None, limit: int) -> RequestTooLarge:
    size = f"{declared} bytes" if declared is not None else "more than that"
    return RequestTooLarge(f"The request body is {size}; at most {limit} bytes are accepted.")


def _counted(receive: Receive, limit: int) -> Receive:
    """A ``receive`` that passes the body on as it comes and raises once more than
    ``limit`` bytes of it came."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large(None, limit)
        return message

    return counted


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the whole body once, then what the server says
    (a disconnect)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
