"""One place where every failure becomes OpenAI's error envelope with its status;
lower-layer errors are translated here. No failure reaches a client as a bare
500 or costs it its connection: :class:`CatchAll` is an ASGI middleware inside
Starlette's (whose handler re-raises, and uvicorn then closes the connection)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor.errors import PipelineUnavailable, RequestError, TransientBrokerError
from conveyor.redis_clients import RedisError
from schemas.openai.requests import invalid_request
from topics.clients import KafkaError

__all__ = ["BACKEND_ERRORS", "install_error_handlers", "error_response", "SafeJSONResponse",
           "CatchAll"]

log = logging.getLogger(__name__)


class NotFound(RequestError):
    """404 for what does not exist, or is not the caller's to see (the same answer)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: UTF-8 as is, or ASCII escapes for what UTF-8 cannot
    hold (lone surrogates)."""

    def render(self, content: Any) -> bytes:
        return safe_json(content)


def safe_json(content: Any) -> bytes:
    """Compact JSON as UTF-8, or with ASCII escapes for what UTF-8 cannot hold (a
    lone surrogate echoed from a request)."""
    try:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def for_client(exc: BaseException, what: str) -> RequestError:
    """``exc`` as a client hears of it: a :class:`RequestError` as it is, anything
    else (a bug) as "Internal error.", logged in full as ``what`` failing."""
    if isinstance(exc, RequestError):
        return exc
    log.error("%s failed", what, exc_info=exc)
    return RequestError("Internal error.")


def error_response(exc: RequestError) -> SafeJSONResponse:
    return SafeJSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers or None)


def _validation(request: Request, exc: Exception) -> SafeJSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(invalid_request(exc.errors()))


def _request_error(request: Request, exc: Exception) -> SafeJSONResponse:
    assert isinstance(exc, RequestError)
    return error_response(exc)


def _http(request: Request, exc: Exception) -> SafeJSONResponse:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(RequestError(str(exc.detail), status=exc.status_code, type=kind))


def _backend(request: Request, exc: Exception) -> SafeJSONResponse:
    log.error("backend failure: %r", exc)
    return error_response(PipelineUnavailable("The pipeline is unavailable; try again."))


class CatchAll:
    """The last word on any exception: a 500 envelope, never a re-raise; after the
    response started, it is logged and the server ends the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.error("unexpected error on %s %s", scope.get("method"), scope.get("path"),
                      exc_info=exc)
            if not started:
                response = error_response(RequestError("Internal error."))
                await response(scope, receive, send)


# what a route meets when Kafka or Redis does not answer: a 503, never a 500 (the
# clients' own errors, and Conveyor's where topics/ and conveyor/redis_clients.py
# translated them)
BACKEND_ERRORS: tuple[type[Exception], ...] = (KafkaError, RedisError, TransientBrokerError)


def install_error_handlers(app: FastAPI) -> None:
    """Every handler, in one place. :class:`CatchAll` is added last, so that it is
    the outermost of the application's own middleware."""
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(HTTPException, _http)
    for backend in BACKEND_ERRORS:
        app.add_exception_handler(backend, _backend)
    app.add_middleware(CatchAll)
