"""The request body limit: a body over ``max_body_bytes`` is refused with 413
before anything parses it or puts it into the pipeline.

:class:`BodyLimit` is an ASGI middleware, so the limit holds in one place for
every route. A ``Content-Length`` over the limit is refused before a byte of
the body is read; a chunked body is counted while it is read, and refused as
soon as it passes the limit, so the gateway never holds more than
``max_body_bytes`` of one request. The body it read is then handed on to the
route as one message.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.errors import InvalidRequest, RequestTooLarge
from gateway.errors import error_response

__all__ = ["BodyLimit"]


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = self._declared_length(scope)
        if declared is None:
            await error_response(InvalidRequest("Content-Length is not a number.",
                                                param="Content-Length"))(scope, receive, send)
            return
        if declared > self.max_bytes:
            await self._too_large(declared, scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large(None, scope, receive, send)
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

    async def _too_large(self, declared: int | None, scope: Scope, receive: Receive,
                         send: Send) -> None:
        size = f"{declared} bytes" if declared is not None else "more than that"
        error = RequestTooLarge(f"The request body is {size}; at most {self.max_bytes} "
                                "bytes are accepted.")
        await error_response(error)(scope, receive, send)


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
