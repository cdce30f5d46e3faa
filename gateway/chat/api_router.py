"""The OpenAI-compatible routes. They only dispatch to :mod:`gateway.serving`
(and, for stored chat completions, :mod:`gateway.stored`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.requests import HTTPConnection

from conveyor.errors import InvalidRequest, ModelNotFound
from conveyor.registry import Registry
from gateway import sse
from gateway.admission import Admitter
from gateway.auth.middleware import identity_of
from gateway.auth.types import Identity
from gateway.chat.choices import choice_generations, collect_choices, stream_choices
from gateway.errors import SafeJSONResponse
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
from gateway.resume import (
    Kind,
    StreamNotFound,
    locate,
    request_id_of,
    resume_after,
    resumed_events,
)
from gateway.serving import Answer, Serving
from gateway.stored import stored_chat_completion, stored_messages
from schemas.openai.requests import ChatCompletionRequest, CompletionRequest, model_list
from schemas.records import Generation

__all__ = ["router", "admit_and_submit"]

router = APIRouter()

TIMEOUT_HEADER = "X-Conveyor-Timeout"

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


@router.post("/v1/chat/completions", response_model=None,
             responses=generation_responses(ChatCompletion))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    serving = _serving(request)
    if body.choices() > 1:
        return await _choices(serving, serving.chat_generation(body.model_copy(update={"n": 1})),
                              body.choices(), bool(body.store), request)
    return await _answer(serving, serving.chat_generation(body), request)


@router.post("/v1/completions", response_model=None,
             responses=generation_responses(Completion))
async def completions(body: CompletionRequest, request: Request) -> Response:
    serving = _serving(request)
    if body.choices() > 1:
        return await _choices(serving, serving.completion_generation(
            body.model_copy(update={"n": 1})), body.choices(), False, request)
    return await _answer(serving, serving.completion_generation(body), request)


@router.get("/v1/chat/completions/{stream_id}/stream", response_model=None)
async def resume_chat_completion(stream_id: str, request: Request,
                                 starting_after: str | None = Query(None)) -> Response:
    """The events of a chat completion stream after ``Last-Event-ID`` (or
    ``?starting_after=N``), from the log then live; without either, all of them."""
    return await _resume(_serving(request), "chat", stream_id, request, starting_after)


@router.get("/v1/chat/completions/{completion_id}", response_model=None,
            responses=stored_responses(ChatCompletion))
async def retrieve_chat_completion(completion_id: str, request: Request) -> SafeJSONResponse:
    """A chat completion created with ``store: true``, rebuilt from the log."""
    return SafeJSONResponse(await stored_chat_completion(_serving(request),
                                                         identity_of(request), completion_id))


@router.get("/v1/chat/completions/{completion_id}/messages", response_model=None,
            responses=stored_responses(None))
async def list_chat_completion_messages(
        completion_id: str, request: Request, after: str | None = None, limit: int = 20,
        order: Literal["asc", "desc"] = "asc") -> SafeJSONResponse:
    """The messages a stored chat completion was asked with."""
    return SafeJSONResponse(await stored_messages(_serving(request), identity_of(request),
                                                  completion_id, after, limit, order))


@router.get("/v1/completions/{stream_id}/stream", response_model=None)
async def resume_completion(stream_id: str, request: Request,
                            starting_after: str | None = Query(None)) -> Response:
    """As for chat completions, for a completion stream (``cmpl-...``)."""
    return await _resume(_serving(request), "completion", stream_id, request, starting_after)


async def _resume(serving: Serving, kind: Kind, stream_id: str, request: Request,
                  starting_after: str | None) -> Response:
    """Find the request in the log; only its tenant may read it (404 for others,
    as for a stream that does not exist)."""
    rid = request_id_of(stream_id, kind)
    after = resume_after(rid, request.headers.get("last-event-id"), starting_after)
    where = await locate(serving.lookup, serving.codec, rid)
    if where is None or where.kind != kind or (
            serving.settings.auth != "none" and where.tenant != identity_of(request).tenant):
        raise StreamNotFound(stream_id)
    events = resumed_events(serving.settings, serving.codec, serving.cancels, where, after,
                            serving.resume_frames)
    return sse.EventStream(events,
                           headers={**_SSE_HEADERS, "x-request-id": rid})


def _timeout(request: HTTPConnection) -> float | None:
    """``X-Conveyor-Timeout``: the request's deadline in seconds (the default otherwise)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise InvalidRequest(f"{TIMEOUT_HEADER} must be a number of seconds in (0, 3600].",
                             param=TIMEOUT_HEADER)
    return value


async def admit_and_submit(serving: Serving, generation: Generation,
                           request: HTTPConnection) -> Answer:
    """Admit (model access, limits) the caller's generation, then submit it with
    the request's deadline and trace; the answer's ticket holds the admission's
    ``x-ratelimit-*`` headers. Every generation route starts here, the WebSocket
    ones too (``request`` is then the handshake)."""
    identity = identity_of(request)
    timeout_s = _timeout(request)
    rid = serving.new_request_id()
    admitter: Admitter = request.app.state.admitter
    ticket = await admitter.admit(identity, generation, rid, serving.deadline_ms(timeout_s))
    try:
        return await serving.submit(generation, identity, timeout_s=timeout_s,
                                    traceparent=request.headers.get("traceparent"),
                                    request_id=rid, ticket=ticket)
    except BaseException:
        ticket.settle(None, produced=False)
        raise


async def _answer(serving: Serving, generation: Generation, request: Request) -> Response:
    """Admit and submit, then answer as JSON or SSE; the admission's
    ``x-ratelimit-*`` headers and the request's ``x-request-id`` go on the response."""
    answer = await admit_and_submit(serving, generation, request)
    # the request's id, as OpenAI names it: what inspect and the log know it by
    headers = {**answer.ticket.headers, "x-request-id": answer.request_id}
    registry: Registry = request.app.state.registry
    if not generation["stream"]:
        result = await serving.collect(generation, answer, request.is_disconnected)
        return SafeJSONResponse(result, headers={**headers, **answer.cache_headers,
                                                 **_fallback(registry, generation, result)})
    first = await serving.first(answer, request.is_disconnected)
    if first is None:  # the client left: nobody reads a status
        return Response(status_code=499)
    opening = json.loads(first["chunk"].partition("\n")[0] or "{}")
    return sse.EventStream(serving.stream(answer, first),
                           headers={**_SSE_HEADERS, **headers, **answer.cache_headers,
                                    **_fallback(registry, generation, opening)})


async def _choices(serving: Serving, generation: Generation, n: int, stored: bool,
                   request: Request) -> Response:
    """``n`` > 1: a request of each choice, answered as one (gateway/chat/choices.py)."""
    if stored:
        raise InvalidRequest("store=true is supported with n=1 only.", param="n")
    generations = choice_generations(generation, n)
    answers: list[Answer] = []
    try:
        for each in generations:
            answers.append(await admit_and_submit(serving, each, request))
        headers = {**answers[0].ticket.headers, "x-request-id": answers[0].request_id}
        registry: Registry = request.app.state.registry
        if not generation["stream"]:
            result = await collect_choices(serving, generations, answers,
                                           request.is_disconnected)
            return SafeJSONResponse(result,
                                    headers={**headers, **_fallback(registry, generation, result)})
        firsts = []
        for answer in answers:
            first = await serving.first(answer, request.is_disconnected)
            if first is None:  # the client left: nobody reads a status
                raise _ClientLeft
            firsts.append(first)
    except BaseException as exc:
        for answer in answers:
            answer.close("another choice failed, or the client left")
        if isinstance(exc, _ClientLeft):
            return Response(status_code=499)
        raise
    opening = json.loads(firsts[0]["chunk"].partition("\n")[0] or "{}")
    return sse.EventStream(
        stream_choices(answers, firsts, serving.settings.sse_keepalive_s,
                       generation["include_usage"]),
        headers={**_SSE_HEADERS, **headers, **_fallback(registry, generation, opening)})


class _ClientLeft(Exception):
    """The client went away before every choice's first reply."""


def _fallback(registry: Registry, generation: Generation, answer: dict[str, Any]
              ) -> dict[str, str]:
    """``x-conveyor-deployment: <model>`` when a canary's deployment answered,
    ``x-conveyor-fallback: <model>`` when a fallback model did (the answer's
    ``model`` names it) instead of the model asked for."""
    model = answer.get("model")
    if not isinstance(model, str) or not model or model == generation["model"]:
        return {}
    asked = registry.find(generation["model"])
    if asked is not None and model in dict(asked.deployments):
        return {"x-conveyor-deployment": model}
    return {"x-conveyor-fallback": model}


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> SafeJSONResponse:
    """The models the caller may use (every model, or its key's allow-list),
    each by its name and by each of its aliases."""
    registry = request.app.state.registry
    identity = identity_of(request)
    names = [(name, 0) for name in _usable(registry, identity)]
    return SafeJSONResponse(model_list(names))


@router.get("/v1/models/{model:path}", response_model=ModelCard,
            responses={404: {"model": ErrorResponse}})
async def model(model: str, request: Request) -> SafeJSONResponse:
    """One model by its name or an alias (``client.models.retrieve``); 404
    ``model_not_found`` for one the registry does not know or the caller may
    not use, as a request for it would get."""
    registry = request.app.state.registry
    if model not in _usable(registry, identity_of(request)):
        raise ModelNotFound(f"The model `{model}` does not exist or you do not have "
                            "access to it.", param="model")
    [card] = model_list([(model, 0)])["data"]
    return SafeJSONResponse(card)


def _usable(registry: Registry, identity: Identity) -> list[str]:
    """Every name and alias the caller may ask for, sorted (a key's allow-list
    may name a model or any of its aliases, as admission reads it)."""
    out: set[str] = set()
    for spec in registry.models.values():
        names = (spec.name, *spec.aliases)
        if any(identity.may_use(n) for n in names):
            out.update(names)
    return sorted(out)


@router.get("/healthz", response_model=HealthReport, responses=HEALTH_RESPONSES)
async def healthz(request: Request) -> SafeJSONResponse:
    ok, body = request.app.state.health.report()
    return SafeJSONResponse(body, status_code=200 if ok else 503)
