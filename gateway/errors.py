"""One place where every failure becomes OpenAI's error envelope with its status.

Lower-layer errors (validation, Kafka, Redis) are translated here; nothing
reaches a client as a bare 500 with a stack trace.
"""

from __future__ import annotations

import logging

from aiokafka.errors import KafkaError
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from conveyor.errors import RequestError

__all__ = ["install_error_handlers", "error_response"]

log = logging.getLogger(__name__)


def error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.envelope(), status_code=exc.status)


def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        message, param = "The request body is not valid JSON.", None
    else:
        message = f"{first.get('msg', 'Invalid request')}" + (f" ({param})" if param else "")
    return error_response(RequestError(message, param=param, status=400,
                                       type="invalid_request_error"))


def _request_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestError)
    return error_response(exc)


def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(RequestError(str(exc.detail), status=exc.status_code, type=kind))


def _backend(request: Request, exc: Exception) -> JSONResponse:
    log.error("backend failure: %s", exc)
    return error_response(RequestError("The pipeline is unavailable; try again.",
                                       status=503, type="service_unavailable",
                                       code="backend_unavailable"))


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error", exc_info=exc)
    return error_response(RequestError("Internal error.", status=500))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(KafkaError, _backend)
    app.add_exception_handler(RedisError, _backend)
    app.add_exception_handler(Exception, _unexpected)
