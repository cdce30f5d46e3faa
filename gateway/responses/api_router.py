"""``POST /v1/responses``, ``GET /v1/responses/{id}`` and its ``input_items``:
they only dispatch to :class:`~gateway.responses.serving.ResponsesServing`. The
GET streams again with
``stream=true``; without it, it is a background response (this router goes
before the jobs router) or a stored one."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from gateway.auth.middleware import identity_of
from gateway.errors import SafeJSONResponse
from gateway.openapi import (
    RESPONSES_OPENAPI,
    RESPONSES_RESPONSES,
    RETRIEVE_RESPONSES,
)
from gateway.responses.serving import ResponsesServing
from gateway.services import service
from schemas.openai.responses import parse_request

__all__ = ["responses_router"]

responses_router = APIRouter()


Responses = Annotated[ResponsesServing, Depends(service("responses"))]


@responses_router.post("/v1/responses", response_model=None, responses=RESPONSES_RESPONSES,
                       openapi_extra=RESPONSES_OPENAPI)
async def create_response(request: Request,
                          responses: Responses) -> Response:
    return await responses.create(parse_request(await request.body()), request)


@responses_router.get("/v1/responses/{response_id}/input_items", response_model=None,
                      responses=RETRIEVE_RESPONSES)
async def list_input_items(
        response_id: str, request: Request, responses: Responses,
        limit: int = Query(20, description="How many items, 1 to 100."),
        order: Literal["asc", "desc"] = Query("desc", description="Newest first by default."),
        after: str | None = Query(None, description="An item id: the items after it."),
        include: Annotated[list[str] | None,
                           Query(description="Accepted; nothing to add here.")] = None
) -> Response:
    """A stored response's own input items, as OpenAI lists them (not its
    instructions, nor the conversation it continued)."""
    return SafeJSONResponse(await responses.input_items(
        identity_of(request), response_id, limit=limit, order=order, after=after))


@responses_router.get("/v1/responses/{response_id}", response_model=None,
                      responses=RETRIEVE_RESPONSES)
async def retrieve_or_stream_response(
        response_id: str, request: Request,
        responses: Responses, stream: bool = False,
        starting_after: str | None = Query(None, description=(
            "With stream=true: the sequence_number after which events are sent."))
) -> Response:
    """A background response (without ``stream``), or a response's events after
    ``starting_after`` (all without it), from the log then live (``stream=true``)."""
    return await responses.retrieve(response_id, request, stream, starting_after)
