"""The chat completions and completions routes, and the models and health
routes beside them. They only dispatch: to :class:`~gateway.chat.serving.ChatServing`,
which the application's services hand them by dependency."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from conveyor.errors import ModelNotFound
from conveyor.registry import Registry
from gateway.auth.middleware import identity_of
from gateway.auth.types import Identity
from gateway.chat.serving import ChatServing
from gateway.errors import SafeJSONResponse
from gateway.health import Health
from gateway.openapi import (
    HEALTH_RESPONSES,
    ChatCompletion,
    Completion,
    ErrorResponse,
    HealthReport,
    ModelCard,
    ModelList,
    generation_responses,
    stored_responses,
)
from gateway.services import service
from schemas.openai.requests import ChatCompletionRequest, CompletionRequest, model_list

__all__ = ["router"]

router = APIRouter()


Models = Annotated[Registry, Depends(service("registry"))]
Chat = Annotated[ChatServing, Depends(service("chat"))]


@router.post("/v1/chat/completions", response_model=None,
             responses=generation_responses(ChatCompletion))
async def chat_completions(body: ChatCompletionRequest, request: Request, chat: Chat) -> Response:
    return await chat.create(body, request)


@router.post("/v1/completions", response_model=None,
             responses=generation_responses(Completion))
async def completions(body: CompletionRequest, request: Request, chat: Chat) -> Response:
    return await chat.create(body, request)


@router.get("/v1/chat/completions/{stream_id}/stream", response_model=None)
async def resume_chat_completion(stream_id: str, request: Request, chat: Chat,
                                 starting_after: str | None = Query(None)) -> Response:
    """The events of a chat completion stream after ``Last-Event-ID`` (or
    ``?starting_after=N``), from the log then live; without either, all of them."""
    return await chat.resume("chat", stream_id, request, starting_after)


@router.get("/v1/chat/completions/{completion_id}", response_model=None,
            responses=stored_responses(ChatCompletion))
async def retrieve_chat_completion(completion_id: str, request: Request,
                                   chat: Chat) -> SafeJSONResponse:
    """A chat completion created with ``store: true``, rebuilt from the log."""
    return SafeJSONResponse(await chat.stored.chat_completion(identity_of(request),
                                                                 completion_id))


@router.get("/v1/chat/completions/{completion_id}/messages", response_model=None,
            responses=stored_responses(None))
async def list_chat_completion_messages(
        completion_id: str, request: Request, chat: Chat, after: str | None = None,
        limit: int = 20, order: Literal["asc", "desc"] = "asc") -> SafeJSONResponse:
    """The messages a stored chat completion was asked with."""
    return SafeJSONResponse(await chat.stored.messages(identity_of(request), completion_id,
                                                       after, limit, order))


@router.get("/v1/completions/{stream_id}/stream", response_model=None)
async def resume_completion(stream_id: str, request: Request, chat: Chat,
                            starting_after: str | None = Query(None)) -> Response:
    """As for chat completions, for a completion stream (``cmpl-...``)."""
    return await chat.resume("completion", stream_id, request, starting_after)


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request, registry: Models) -> SafeJSONResponse:
    """The models the caller may use (every model, or its key's allow-list),
    each by its name and by each of its aliases."""
    identity = identity_of(request)
    names = [(name, 0) for name in _usable(registry, identity)]
    return SafeJSONResponse(model_list(names))


@router.get("/v1/models/{model:path}", response_model=ModelCard,
            responses={404: {"model": ErrorResponse}})
async def model(model: str, request: Request, registry: Models) -> SafeJSONResponse:
    """One model by its name or an alias (``client.models.retrieve``); 404
    ``model_not_found`` for one the registry does not know or the caller may
    not use, as a request for it would get."""
    if model not in _usable(registry, identity_of(request)):
        raise ModelNotFound(f"The model `{model}` does not exist or you do not have "
                            "access to it.", param="model")
    [card] = model_list([(model, 0)])["data"]
    return SafeJSONResponse(card)


@router.get("/healthz", response_model=HealthReport, responses=HEALTH_RESPONSES)
async def healthz(health: Annotated[Health, Depends(service("health"))]) -> SafeJSONResponse:
    ok, body = health.report()
    return SafeJSONResponse(body, status_code=200 if ok else 503)


def _usable(registry: Registry, identity: Identity) -> list[str]:
    """Every name and alias the caller may ask for, sorted (a key's allow-list
    may name a model or any of its aliases, as admission reads it)."""
    out: set[str] = set()
    for spec in registry.models.values():
        names = (spec.name, *spec.aliases)
        if any(identity.may_use(n) for n in names):
            out.update(names)
    return sorted(out)
