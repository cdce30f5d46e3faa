"""The OpenAI-compatible routes. They only dispatch to :mod:`gateway.serving`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from conveyor.errors import InvalidRequest
from gateway.errors import SafeJSONResponse
from gateway.openapi import (
    HEALTH_RESPONSES,
    ChatCompletion,
    Completion,
    HealthReport,
    ModelList,
    generation_responses,
)
from gateway.protocol import ChatCompletionRequest, CompletionRequest, model_list
from gateway.serving import Serving
from schemas.records import Generation

__all__ = ["router"]

router = APIRouter()

TIMEOUT_HEADER = "X-Conveyor-Timeout"

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


@router.post("/v1/chat/completions", response_model=None,
             responses=generation_responses(ChatCompletion))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    serving = _serving(request)
    return await _answer(serving, serving.chat_generation(body), request)


@router.post("/v1/completions", response_model=None,
             responses=generation_responses(Completion))
async def completions(body: CompletionRequest, request: Request) -> Response:
    serving = _serving(request)
    return await _answer(serving, serving.completion_generation(body), request)


def _timeout(request: Request) -> float | None:
    """``X-Conveyor-Timeout``: the request's deadline in seconds (the default otherwise)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise InvalidRequest(f"{TIMEOUT_HEADER} must be a number of seconds in (0, 3600].",
                             param=TIMEOUT_HEADER)
    return value


async def _answer(serving: Serving, generation: Generation, request: Request) -> Response:
    answer = await serving.submit(generation, timeout_s=_timeout(request),
                                  traceparent=request.headers.get("traceparent"))
    if not generation["stream"]:
        result = await serving.collect(generation, answer, request.is_disconnected)
        return SafeJSONResponse(result)
    first = await serving.first(answer, request.is_disconnected)
    if first is None:  # the client left: nobody reads a status
        return Response(status_code=499)
    return StreamingResponse(serving.stream(answer, first), media_type="text/event-stream",
                             headers=_SSE_HEADERS)


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> SafeJSONResponse:
    registry = request.app.state.registry
    names = [(name, 0) for name in sorted(registry.models)]
    return SafeJSONResponse(model_list(names))


@router.get("/healthz", response_model=HealthReport, responses=HEALTH_RESPONSES)
async def healthz(request: Request) -> SafeJSONResponse:
    ok, body = request.app.state.health.report()
    return SafeJSONResponse(body, status_code=200 if ok else 503)
