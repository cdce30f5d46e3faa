"""The OpenAI-compatible routes. They only dispatch to :mod:`gateway.serving`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.protocol import ChatCompletionRequest, CompletionRequest, model_list
from gateway.serving import Serving
from schemas.records import Generation

__all__ = ["router"]

router = APIRouter()

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    serving = _serving(request)
    return await _answer(serving, serving.chat_generation(body), request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    serving = _serving(request)
    return await _answer(serving, serving.completion_generation(body), request)


async def _answer(serving: Serving, generation: Generation, request: Request) -> Response:
    answer = await serving.submit(generation)
    if not generation["stream"]:
        result = await serving.collect(generation, answer, request.is_disconnected)
        return JSONResponse(result)
    first = await serving.first(answer)
    return StreamingResponse(serving.stream(answer, first), media_type="text/event-stream",
                             headers=_SSE_HEADERS)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    registry = request.app.state.registry
    names = [(name, 0) for name in sorted(registry.models)]
    return model_list(names)


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    ok, detail = request.app.state.health()
    return JSONResponse({"status": "ok" if ok else "unavailable", "detail": detail},
                        status_code=200 if ok else 503)
