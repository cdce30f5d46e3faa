"""``POST /v1/responses``: it only dispatches to :mod:`gateway.responses.serving`,
or, for ``background: true``, to ``app.state.background_responses``
(:class:`gateway.responses.types.BackgroundResponses`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from conveyor.errors import InvalidRequest
from gateway.api_router import admit_and_submit
from gateway.auth.middleware import identity_of
from gateway.errors import SafeJSONResponse
from gateway.responses.openapi import RESPONSES_OPENAPI, RESPONSES_RESPONSES
from gateway.responses.protocol import parse_request
from gateway.responses.serving import (
    collect_response,
    first_reply,
    generation_of,
    stream_events,
)
from gateway.responses.types import BackgroundResponses
from gateway.serving import Serving

__all__ = ["responses_router"]

responses_router = APIRouter()

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@responses_router.post("/v1/responses", response_model=None, responses=RESPONSES_RESPONSES,
                       openapi_extra=RESPONSES_OPENAPI)
async def create_response(request: Request) -> Response:
    body = parse_request(await request.body())
    generation = generation_of(body)
    if body.background:
        background: BackgroundResponses | None = getattr(
            request.app.state, "background_responses", None)
        if background is None:
            raise InvalidRequest("background responses are not enabled", param="background")
        created = await background.create(identity_of(request), body, generation)
        return SafeJSONResponse(created)
    serving: Serving = request.app.state.serving
    answer = await admit_and_submit(serving, generation, request)
    headers = answer.ticket.headers
    if not body.stream:
        result = await collect_response(serving, generation, answer, body,
                                        request.is_disconnected)
        return SafeJSONResponse(result, headers=headers or None)
    first = await first_reply(serving, answer, body, request.is_disconnected)
    if first is None:  # the client left: nobody reads a status
        return Response(status_code=499)
    return StreamingResponse(stream_events(serving, generation, answer, body, first),
                             media_type="text/event-stream",
                             headers={**_SSE_HEADERS, **headers})
