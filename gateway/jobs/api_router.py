"""The Batch API's routes (and retrieving or cancelling a background response).
They only dispatch to :mod:`gateway.jobs.batches` and
:mod:`gateway.jobs.background`."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.auth.middleware import identity_of
from gateway.errors import SafeJSONResponse
from gateway.jobs.background import BackgroundResponses
from gateway.jobs.batches import BatchCreateRequest, Batches

__all__ = ["jobs_router"]

jobs_router = APIRouter()


def _batches(request: Request) -> Batches:
    batches: Batches = request.app.state.batches
    return batches


@jobs_router.post("/v1/batches")
async def create_batch(body: BatchCreateRequest, request: Request) -> SafeJSONResponse:
    return SafeJSONResponse(await _batches(request).create(identity_of(request), body))


@jobs_router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None,
                       limit: int = 20) -> SafeJSONResponse:
    return SafeJSONResponse(_batches(request).listing(identity_of(request), after, limit))


@jobs_router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> SafeJSONResponse:
    return SafeJSONResponse(await _batches(request).retrieve(identity_of(request), batch_id))


@jobs_router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> SafeJSONResponse:
    return SafeJSONResponse(await _batches(request).cancel(identity_of(request), batch_id))


def _background(request: Request) -> BackgroundResponses:
    background: BackgroundResponses = request.app.state.background_responses
    return background


async def retrieve_response(response_id: str, request: Request) -> SafeJSONResponse:
    """``GET /v1/responses/{id}`` without ``stream``: the route is the responses
    router's (gateway/responses/api_router.py), which streams with it."""
    return SafeJSONResponse(await _background(request).retrieve(identity_of(request),
                                                                response_id))


@jobs_router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> SafeJSONResponse:
    return SafeJSONResponse(await _background(request).cancel(identity_of(request),
                                                              response_id))
