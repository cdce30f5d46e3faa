"""The Batch API's routes (and cancelling a background response).
They only dispatch to :mod:`gateway.jobs.batches` and
:mod:`gateway.jobs.background`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from gateway.auth.middleware import identity_of
from gateway.errors import SafeJSONResponse
from gateway.jobs.background import BackgroundResponses
from gateway.jobs.batches import BatchCreateRequest, Batches
from gateway.services import service

__all__ = ["jobs_router"]

jobs_router = APIRouter()


Jobs = Annotated[Batches, Depends(service("batches"))]


@jobs_router.post("/v1/batches")
async def create_batch(body: BatchCreateRequest, request: Request,
                       batches: Jobs) -> SafeJSONResponse:
    return SafeJSONResponse(await batches.create(identity_of(request), body))


@jobs_router.get("/v1/batches")
async def list_batches(request: Request, batches: Jobs,
                       after: str | None = None, limit: int = 20) -> SafeJSONResponse:
    return SafeJSONResponse(batches.listing(identity_of(request), after, limit))


@jobs_router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request,
                         batches: Jobs) -> SafeJSONResponse:
    return SafeJSONResponse(await batches.retrieve(identity_of(request), batch_id))


@jobs_router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request,
                       batches: Jobs) -> SafeJSONResponse:
    return SafeJSONResponse(await batches.cancel(identity_of(request), batch_id))


@jobs_router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request,
                          background: Annotated[BackgroundResponses, Depends(service("background"))]
                          ) -> SafeJSONResponse:
    return SafeJSONResponse(await background.cancel(identity_of(request), response_id))
