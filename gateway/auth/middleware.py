"""Authentication at the edge: every ``/v1/`` request is identified before a route
reads its body, its :class:`~gateway.auth.types.Identity` put in the request's
state (:func:`identity_of`); 503 before the authenticator exists. A refused
WebSocket handshake is accepted and closed: 1008, or 1013 when it cannot check."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from conveyor.errors import PipelineUnavailable, RequestError
from gateway.auth.authenticate import ANONYMOUS, Authenticator
from gateway.auth.types import Identity
from gateway.errors import error_response
from gateway.websocket.protocol import close_code_of, close_reason

__all__ = ["AuthMiddleware", "FindAuthenticator", "identity_of"]

_PROTECTED = "/v1/"


#: the authenticator of the application a request reached (None: not made yet)
FindAuthenticator = Callable[[Scope], "Authenticator | None"]


class AuthMiddleware:
    def __init__(self, app: ASGIApp, authenticator: FindAuthenticator) -> None:
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or \
                not str(scope.get("path", "")).startswith(_PROTECTED):
            await self.app(scope, receive, send)
            return
        authenticator = self.authenticator(scope)
        if authenticator is None:  # keys or JWTs cannot be checked yet: nothing is served
            await _refuse(PipelineUnavailable("The gateway is starting; try again shortly."),
                          scope, receive, send)
            return
        authorization = api_key = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-api-key":  # Anthropic's clients send their key so
                api_key = value.decode("latin-1")
        if authorization is None and api_key:
            authorization = f"Bearer {api_key.strip()}"
        try:
            identity = await authenticator.identify(authorization)
        except RequestError as exc:
            await _refuse(exc, scope, receive, send)
            return
        scope.setdefault("state", {})["identity"] = identity
        await self.app(scope, receive, send)


async def _refuse(exc: RequestError, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "websocket":
        await error_response(exc)(scope, receive, send)
        return
    if (await receive())["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.close", "code": close_code_of(exc),
                "reason": close_reason(exc.message)})


def identity_of(request: HTTPConnection) -> Identity:
    """The caller of a request or WebSocket (anonymous where no authentication ran)."""
    identity: Identity = getattr(request.state, "identity", ANONYMOUS)
    return identity
