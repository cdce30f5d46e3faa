"""``POST /v1/responses``: it only dispatches to :mod:`gateway.responses.serving`,
or, for ``background: true``, to ``app.state.background_responses``
(:class:`gateway.responses.types.BackgroundResponses`).

``GET /v1/responses/{id}`` with ``stream=true`` streams a response's events
again, after ``starting_after`` (:func:`gateway.responses.serving.resume_response`).
Without it, it is the background response, as :mod:`gateway.jobs.api_router`
serves it (this route is the one that matches, this router being included
first, so it hands that case to the jobs route), or else a stored direct
response rebuilt from the log (:func:`gateway.responses.serving.stored_response`)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from conveyor.errors import InvalidRequest, RequestError
from gateway import sse
from gateway.auth.middleware import identity_of
from gateway.chat.api_router import admit_and_submit
from gateway.errors import SafeJSONResponse
from gateway.jobs.api_router import retrieve_response
from gateway.responses.openapi import (
    RESPONSES_OPENAPI,
    RESPONSES_RESPONSES,
    RETRIEVE_RESPONSES,
)
from gateway.responses.serving import (
    collect_response,
    first_reply,
    generation_of,
    response_request_id,
    resume_response,
    sequence_after,
    stored_response,
    stream_events,
)
from gateway.responses.types import BackgroundResponses
from gateway.serving import Serving
from schemas.openai.responses import parse_request

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
    return sse.EventStream(stream_events(serving, generation, answer, body, first),
                           headers={**_SSE_HEADERS, **headers})


@responses_router.get("/v1/responses/{response_id}", response_model=None,
                      responses=RETRIEVE_RESPONSES)
async def retrieve_or_stream_response(
        response_id: str, request: Request, stream: bool = False,
        starting_after: str | None = Query(None, description=(
            "With stream=true: the sequence_number after which events are sent."))
) -> Response:
    """A background response (without ``stream``), or a response's events after
    ``starting_after`` (all without it), from the log then live (``stream=true``)."""
    if not stream:
        if getattr(request.app.state, "background_responses", None) is not None:
            try:
                return await retrieve_response(response_id, request)
            except RequestError as exc:
                if exc.status != 404:
                    raise
        response_request_id(response_id)  # 404 for what is no response id, before the log
        return SafeJSONResponse(await stored_response(request.app.state.serving,
                                                      identity_of(request), response_id))
    rid = response_request_id(response_id)
    after = sequence_after(starting_after)
    events = await resume_response(request.app.state.serving, identity_of(request),
                                   response_id, after,
                                   getattr(request.app.state, "background_responses", None))
    return sse.EventStream(events,
                           headers={**_SSE_HEADERS, "x-request-id": rid})
