"""The OpenAPI document says what the API really answers: FastAPI's 422 and its
validation schemas removed (Conveyor answers 400 with OpenAI's error envelope),
each operation listing its real statuses, 200 with the object that
:mod:`gateway.chat.serving` or :mod:`gateway.responses.objects` builds (or
``text/event-stream``). The fuzz test checks every answer against them.
``POST /v1/responses``'s body is validated by
:func:`schemas.openai.responses.parse_request`, not FastAPI, so its schema is
written into the operation (inlined: the components know no ``$defs``)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from schemas.openai.responses import ResponsesRequest

__all__ = ["ErrorResponse", "ChatCompletion", "Completion", "ModelCard", "ModelList",
           "HealthReport", "error", "generation_responses", "stored_responses", "HEALTH_RESPONSES",
           "install_openapi", "ResponseObject", "RESPONSES_OPENAPI", "RESPONSES_RESPONSES",
           "RETRIEVE_RESPONSES", "request_schema"]


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


def error(description: str) -> dict[str, Any]:
    """An error status of an operation: OpenAI's envelope, and what it means there."""
    return {"model": ErrorResponse, "description": description}


_SSE = {"text/event-stream": {"schema": {
    "type": "string",
    "description": "With stream: true, server-sent events: one `data:` line per "
                   "OpenAI chunk object, `: keep-alive` comments while waiting, an error "
                   "envelope as an event if the request fails after the stream began, "
                   "and `data: [DONE]` last."}}}

GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: error("The request is invalid or asks for what this server does not support "
                "(param names the field)."),
    401: error("With CONVEYOR_AUTH=keys or jwt: no key, or one that is unknown, revoked "
                "or expired, or a token that does not verify (code invalid_api_key)."),
    404: error("The model is not known, or not one the caller's key may use "
                "(code model_not_found)."),
    429: error("Over a requests-, tokens- or concurrency limit of the key or its tenant "
                "(rate_limit_exceeded; Retry-After and x-ratelimit-* say when), or the "
                "tenant's token quota is spent (insufficient_quota)."),
    413: error("The body is larger than the gateway accepts, or the pipeline can carry "
                "(code request_too_large)."),
    500: error("The engine failed (code engine_error)."),
    503: error("No worker serves the model (no_worker_available), or the pipeline is "
                "unavailable (pipeline_unavailable)."),
    504: error("The request did not finish within its deadline (deadline_exceeded)."),
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
            404: error("Not stored (store was not true), made through another API, not "
                        "the caller's tenant's, past the log's retention, or unknown "
                        "(code not_found)."),
            503: error("Kafka cannot be reached to read the log (pipeline_unavailable)."),
            504: error("The answer was still being generated at its deadline.")}


# -- the Responses API ----------------------------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's Response object, as Conveyor builds it."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage]
    parallel_tool_calls: bool
    store: bool
    temperature: float
    tool_choice: str
    tools: list[Any]
    top_p: float
    usage: ResponseUsage | None
    metadata: dict[str, str]


def _inlined(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inlined(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inlined(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inlined(v, defs) for v in node]
    return node


def request_schema(model: type[BaseModel] = ResponsesRequest) -> dict[str, Any]:
    """A request body's JSON schema (the Responses API's by default), with every
    ``$ref`` inlined (none recurse)."""
    schema = model.model_json_schema()
    inlined: dict[str, Any] = _inlined(schema, schema.get("$defs", {}))
    return inlined


RESPONSES_OPENAPI: dict[str, Any] = {"requestBody": {
    "required": True,
    "content": {"application/json": {"schema": request_schema()}},
}}

RESPONSES_RESPONSES: dict[int | str, dict[str, Any]] = generation_responses(ResponseObject)
RESPONSES_RESPONSES[200] = {**RESPONSES_RESPONSES[200], "content": {"text/event-stream": {
    "schema": {"type": "string", "description":
               "With stream: true, server-sent events, each an `event:` line with the "
               "event's type and a `data:` line with its JSON: response.created, "
               "response.in_progress, response.output_item.added, "
               "response.content_part.added, response.output_text.delta..., "
               "response.output_text.done, response.content_part.done, "
               "response.output_item.done, then response.completed or "
               "response.incomplete (or response.failed after an error), numbered by "
               "sequence_number; `: keep-alive` comments while waiting."}}}}

RETRIEVE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": ResponseObject, "description":
          "Without stream: the background response as it stands. With stream=true: the "
          "response's events numbered above starting_after (all without it), as "
          "server-sent events like those of POST /v1/responses with stream: true, read "
          "from the log then live, on any gateway replica.",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    400: error("starting_after is not a number >= 0, or stream=true names a background "
               "response, whose events are not streamed (param stream): poll it instead."),
    404: error("No such response, or not the caller's tenant's (code not_found)."),
    503: error("The log cannot be read (code pipeline_unavailable)."),
}


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
