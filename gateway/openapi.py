"""The OpenAPI document says what the API really answers.

FastAPI documents a 422 with its own validation schema for every route with a
body; Conveyor answers 400 with OpenAI's error envelope instead, and also
404, 413, 500, 503 and 504. Generated clients and fuzzers read this document,
so each operation lists its real responses: 200 with the response object
(or, for ``stream: true``, ``text/event-stream``), and every error status with
:class:`ErrorResponse`. The response models here describe what
:mod:`gateway.chat.serving` builds; the fuzz test checks every answer against them
through the document.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

__all__ = ["ErrorResponse", "ChatCompletion", "Completion", "ModelCard", "ModelList",
           "HealthReport", "generation_responses", "stored_responses", "HEALTH_RESPONSES",
           "install_openapi"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope, the body of every error status."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="of the prompt's tokens, how many the engine's "
                                           "prefix cache held (0 where the engine does not say)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class _Choice(BaseModel):
    index: int
    logprobs: None
    finish_reason: str | None


class ChatChoice(_Choice):
    message: AssistantMessage


class CompletionChoice(_Choice):
    text: str


class _Answer(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage


class ChatCompletion(_Answer):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class Completion(_Answer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TaskReport(BaseModel):
    state: Literal["starting", "ok", "degraded", "failed"]
    detail: str
    since: float


class BreakerReport(BaseModel):
    state: Literal["open", "half_open"]
    failures: int
    open_for_s: float
    reason: str


class HealthReport(BaseModel):
    status: Literal["starting", "ok", "degraded", "failed"]
    gateway: str
    tasks: dict[str, TaskReport]
    breakers: dict[str, BreakerReport] = Field(
        default_factory=dict, description="Workers whose circuit breaker is not closed: "
        "schedule sends them no work (open) or one probe (half_open).")


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


_SSE = {"text/event-stream": {"schema": {
    "type": "string",
    "description": "With stream: true, server-sent events: one `data:` line per "
                   "OpenAI chunk object, `: keep-alive` comments while waiting, an error "
                   "envelope as an event if the request fails after the stream began, "
                   "and `data: [DONE]` last."}}}

GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("The request is invalid or asks for what this server does not support "
                "(param names the field)."),
    401: _error("With CONVEYOR_AUTH=keys or jwt: no key, or one that is unknown, revoked "
                "or expired, or a token that does not verify (code invalid_api_key)."),
    404: _error("The model is not known, or not one the caller's key may use "
                "(code model_not_found)."),
    429: _error("Over a requests-, tokens- or concurrency limit of the key or its tenant "
                "(rate_limit_exceeded; Retry-After and x-ratelimit-* say when), or the "
                "tenant's token quota is spent (insufficient_quota)."),
    413: _error("The body is larger than the gateway accepts, or the pipeline can carry "
                "(code request_too_large)."),
    500: _error("The engine failed (code engine_error)."),
    503: _error("No worker serves the model (no_worker_available), or the pipeline is "
                "unavailable (pipeline_unavailable)."),
    504: _error("The request did not finish within its deadline (deadline_exceeded)."),
}

HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": HealthReport,
          "description": "A background task is starting, degraded or failed."},
}


def generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The responses of a generation route whose unstreamed answer is ``model``."""
    return {200: {"model": model, "description": "The answer, or its stream.",
                  "content": _SSE}, **GENERATION_RESPONSES}


def stored_responses(model: type[BaseModel] | None) -> dict[int | str, dict[str, Any]]:
    """The responses of a route reading a stored answer (``model``) back."""
    ok: dict[str, Any] = {"description": "The stored answer, rebuilt from the log."}
    if model is not None:
        ok["model"] = model
    return {200: ok,
            400: GENERATION_RESPONSES[400], 401: GENERATION_RESPONSES[401],
            404: _error("Not stored (store was not true), made through another API, not "
                        "the caller's tenant's, past the log's retention, or unknown "
                        "(code not_found)."),
            503: _error("Kafka cannot be reached to read the log (pipeline_unavailable)."),
            504: _error("The answer was still being generated at its deadline.")}


def install_openapi(app: FastAPI) -> None:
    """Build the document once, without FastAPI's 422 and its validation schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description=app.description)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
