"""The embeddings route. It only dispatches, to
:class:`~gateway.embeddings.serving.EmbeddingServing`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.requests import HTTPConnection

from gateway.embeddings.serving import EmbeddingServing
from gateway.openapi import GENERATION_RESPONSES
from gateway.services import services_of
from schemas.openai.embeddings import EmbeddingBody

__all__ = ["embeddings_router"]

embeddings_router = APIRouter()


async def _serving(connection: HTTPConnection) -> EmbeddingServing:
    services = services_of(connection)
    return EmbeddingServing(services.settings, services.submitter, services.registry)


@embeddings_router.post("/v1/embeddings", response_model=None, responses={
    200: {"description": "OpenAI's list of embedding objects, in the inputs' order."},
    **GENERATION_RESPONSES})
async def embeddings(body: EmbeddingBody, request: Request,
                     serving: Annotated[EmbeddingServing, Depends(_serving)]) -> Response:
    return await serving.create(body, request)
