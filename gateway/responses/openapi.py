"""What ``/openapi.json`` says of ``POST /v1/responses`` and of streaming one
again (``GET /v1/responses/{id}?stream=true``).

The body is validated by :func:`schemas.openai.responses.parse_request`,
not by FastAPI, so the request schema is written into the operation here
(inlined: the document's components know nothing of pydantic's ``$defs``).
The 200 answer is described by :class:`ResponseObject`, which mirrors what
:func:`gateway.responses.objects.response_object` builds; the error statuses
are those of every generation route.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from gateway.openapi import ErrorResponse, generation_responses
from schemas.openai.responses import ResponsesRequest

__all__ = ["ResponseObject", "RESPONSES_OPENAPI", "RESPONSES_RESPONSES", "RETRIEVE_RESPONSES",
           "request_schema"]


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


def request_schema() -> dict[str, Any]:
    """The request body's JSON schema, with every ``$ref`` inlined (none recurse)."""
    schema = ResponsesRequest.model_json_schema()
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
    400: {"model": ErrorResponse, "description":
          "starting_after is not a number >= 0, or stream=true names a background "
          "response, whose events are not streamed (param stream): poll it instead."},
    404: {"model": ErrorResponse, "description":
          "No such response, or not the caller's tenant's (code not_found)."},
    503: {"model": ErrorResponse, "description":
          "The log cannot be read (code pipeline_unavailable)."},
}
