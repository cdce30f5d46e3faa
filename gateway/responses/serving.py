"""Serving a Responses API request through the chat pipeline (docs/api/responses.md):
a chat generation (``instructions`` first), admitted and submitted as chat is,
answered as one Response object or its events; the id is ``resp_`` and the
request id, and a chat ``messages[k]`` param is named as its Responses field.

:func:`response_events` makes the events of any reply source, live or read
back, numbered only by the replies, so a resumed stream joins on any replica;
its objects are rebuilt from the recorded generation (:func:`recorded_request`).
Only the tenant may read a response (else 404); a background one cannot stream."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, Literal

from fastapi.responses import Response
from starlette.requests import Request

from conveyor.errors import InvalidRequest, RequestError
from conveyor.settings import Settings
from gateway import sse
from gateway.answer import Answer, Disconnected
from gateway.auth.middleware import identity_of
from gateway.auth.types import Identity
from gateway.errors import NotFound, SafeJSONResponse, for_client
from gateway.images import ImageIntake
from gateway.jobs.background import BackgroundResponses
from gateway.replies import Folded, ReplySource
from gateway.responses.events import ResponseEvents, frame
from gateway.responses.objects import (
    input_items,
    is_stored,
    item_page,
    new_response_id,
    response_object,
)
from gateway.resume import (
    Framer,
    Recorded,
    RecordedReplies,
    StreamNotFound,
    request_id_of,
    resumed_events,
)
from gateway.stored import StoredAnswers
from gateway.submission import Submitter
from schemas.openai.logprobs import chat_logprobs
from schemas.openai.response_items import output_items
from schemas.openai.responses import (
    LOGPROBS_INCLUDE,
    FunctionChoice,
    FunctionTool,
    InputMessage,
    ResponsesRequest,
    answer_items,
    conversation,
)
from schemas.records import Generation, ImageRef, Reply, Sampling
from workers.outputs import error_info

__all__ = ["ResponsesServing", "generation_of", "input_param", "translated", "response_events",
           "ResponseNotFound", "response_request_id", "sequence_after", "recorded_request"]

_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")
_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens"}


def generation_of(body: ResponsesRequest,
                  images: Mapping[tuple[int, int], ImageRef] | None = None) -> Generation:
    """The chat generation a Responses request asks for, with its stored images
    (gateway/images.py)."""
    messages = body.messages(images)
    sampling = Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=1.0 if body.top_p is None else body.top_p,
                        max_tokens=body.max_output_tokens, stop=[], seed=None,
                        presence_penalty=0.0, frequency_penalty=0.0, logit_bias={},
                        logprobs=body.logprobs_asked()[0], top_logprobs=body.logprobs_asked()[1])
    return Generation(kind="chat", model=body.model, messages=messages, prompt=None,
                      sampling=sampling, stream=bool(body.stream), include_usage=False,
                      created=int(time.time()), store=is_stored(body),
                      metadata=dict(body.metadata or {}), api="responses",
                      response_format=body.text.format.record()
                      if body.text and body.text.format else None, tools=body.tools_record(),
                      previous_response_id="", history_messages=0,
                      embedding=None)


def input_param(param: str | None, body: ResponsesRequest) -> str | None:
    """A chat ``param`` (``messages[k].content``, ``messages``, ``max_tokens``) as the
    Responses field it came from."""
    if param in _RENAMED:
        return _RENAMED[param]
    match = _MESSAGE_PARAM.match(param or "")
    if param is None or match is None:
        return param
    index = int(match.group(1)) - (body.instructions is not None)
    if index < 0:
        return "instructions"
    if isinstance(body.input, str):
        return "input"
    return f"input[{index}]" + param[match.end():]


def translated(exc: RequestError, body: ResponsesRequest) -> RequestError:
    """``exc`` naming the Responses field its chat ``param`` came from."""
    exc.param = input_param(exc.param, body)
    return exc


async def response_events(source: ReplySource, first: Reply | None, body: ResponsesRequest,
                          created: int, within: float | None,
                          completed_at: Callable[[], int] = lambda: int(time.time())
                          ) -> AsyncGenerator[dict[str, Any] | None, None]:
    """The events of the response to ``source``'s request from its replies: the
    opening, the deltas, then the closing or ``response.failed``; None when
    ``within`` passed without a reply. ``first`` is a reply already read."""
    events = ResponseEvents(new_response_id(source.request_id), created, body)
    for event in events.opening():
        yield event
    reply = first
    while True:
        if reply is None:
            try:
                reply = await source.next(within=within)
            except Exception as exc:  # the stream began: the error becomes an event
                error = for_client(exc, f"stream {source.request_id}")
                for event in events.failure(error_info(translated(error, body))):
                    yield event
                return
            if reply is None:
                yield None
                continue
        for event in events.delta(reply["text"], reply.get("logprobs")):
            yield event
        if reply["kind"] == "final":
            for event in events.closing(reply["finish_reason"], reply["usage"],
                                        completed_at()):
                yield event
            return
        reply = None


_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


async def _sse(events: AsyncGenerator[dict[str, Any] | None, None],
               after: int = -1) -> AsyncIterator[bytes]:
    """The events numbered above ``after`` as SSE; a keep-alive comment for a wait.
    The event that ends a response is the stream's last frame (gateway/sse.py)."""
    async with contextlib.aclosing(events):
        async for event in events:
            if event is None:
                yield sse.comment()
            elif event["sequence_number"] > after:
                yield sse.Last(frame(event)) if event["type"] in _ENDS else frame(event)


# -- resuming ---------------------------------------------------------------------

class ResponseNotFound(NotFound):
    """404 for a response that does not exist, or is not the caller's to see."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.")


class PreviousResponseNotFound(NotFound):
    """404 for a ``previous_response_id`` that names no stored response of the
    caller's (another tenant's, one not stored, one that never was)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Previous response with id '{response_id}' not found.",
                         param="previous_response_id")


def response_request_id(response_id: str) -> str:
    """The pipeline's request id a response id names (``resp_`` and it)."""
    rid = response_id.removeprefix("resp_")
    try:
        if rid == response_id or request_id_of(rid, "chat") != rid:
            raise ResponseNotFound(response_id)
    except StreamNotFound:
        raise ResponseNotFound(response_id) from None
    return rid


def sequence_after(starting_after: str | None) -> int:
    """The last ``sequence_number`` the client has (-1: none, send every event)."""
    if starting_after is None:
        return -1
    raw = starting_after.strip()
    if not raw.isdigit():
        raise InvalidRequest("starting_after must be a sequence_number: an integer >= 0.",
                             param="starting_after")
    return int(raw)


def recorded_request(generation: Generation) -> ResponsesRequest:
    """The request as the log holds it (its generation): what the response objects
    echo, as far as it can be known (see the module)."""
    messages = generation["messages"]
    told = len(messages) > 1 and messages[0]["role"] == "system"
    own = messages[told + generation.get("history_messages", 0):]
    sampling = generation["sampling"]
    tools = generation.get("tools")
    functions = [FunctionTool.model_construct(
        type="function", name=f["name"], description=f["description"] or None,
        parameters=json.loads(f["parameters"]) if f["parameters"] else None,
        strict=f["strict"]) for f in (tools["functions"] if tools else [])]
    choice: Any = None
    if tools is not None:
        choice = FunctionChoice.model_construct(type="function", name=tools["function"]) \
            if tools["choice"] == "function" else tools["choice"]
    return ResponsesRequest.model_construct(
        model=generation["model"],
        tools=functions or None, tool_choice=choice,
        include=[LOGPROBS_INCLUDE] if sampling.get("logprobs") else None,
        top_logprobs=sampling.get("top_logprobs") or None,
        parallel_tool_calls=tools["parallel"] if tools is not None else None,
        input=[InputMessage.model_construct(role=m["role"], content=m["content"])
               for m in own],
        previous_response_id=generation.get("previous_response_id") or None,
        instructions=messages[0]["content"] if told else None,
        max_output_tokens=sampling["max_tokens"], temperature=sampling["temperature"],
        top_p=sampling["top_p"], stream=True, store=generation.get("store", False),
        metadata=generation.get("metadata") or None)


class ResponsesServing:
    """``/v1/responses``: what its routes dispatch to. ``background`` takes the
    requests with ``background: true`` (none: they are refused with a 400)."""

    def __init__(self, settings: Settings, submitter: Submitter, stored: StoredAnswers,
                 background: BackgroundResponses | None = None,
                 images: ImageIntake | None = None) -> None:
        self.settings = settings
        self.images = images  # none: image parts are refused, naming them
        self.submitter = submitter  # and its cancels, which a resumed stream's leaving sends
        self.stored = stored
        self.background = background

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        """The response as one object, as SSE events, or (``background``) queued."""
        images = await self.images.input_refs(body, identity_of(request)) \
            if self.images is not None else {}
        generation = generation_of(body, images)
        if body.previous_response_id is not None:
            generation = await self.continued(identity_of(request), body, generation)
        if body.background:
            if self.background is None:
                raise InvalidRequest("background responses are not enabled",
                                     param="background")
            created = await self.background.create(identity_of(request), body, generation)
            return SafeJSONResponse(created)
        answer = await self.submitter.admit_and_submit(generation, request)
        headers = answer.ticket.headers
        if not body.stream:
            result = await self.collect(generation, answer, body, request.is_disconnected)
            return SafeJSONResponse(result, headers=headers or None)
        first = await self.first(answer, body, request.is_disconnected)
        if first is None:  # the client left: nobody reads a status
            return Response(status_code=499)
        return sse.EventStream(self.stream(generation, answer, body, first),
                               headers={**sse.HEADERS, **headers})

    async def continued(self, identity: Identity, body: ResponsesRequest,
                        generation: Generation) -> Generation:
        """``generation`` continuing the conversation of the response it names: that
        response's turns (its input, not its instructions, as OpenAI does, then
        its output) go before this request's input. 404 unless it is a stored
        response of the caller's (a background one included); 400 when it failed,
        was cancelled, or is a background one that has not ended yet (a direct
        one still streaming is waited for, up to its deadline)."""
        previous_id = body.previous_response_id or ""
        prior, said = await self._turns_of(identity, previous_id)
        told = len(prior["messages"]) > 1 and prior["messages"][0]["role"] == "system"
        history = [*prior["messages"][told:], *conversation(None, answer_items(said))]
        own = generation["messages"]
        instructions = own[:1] if body.instructions is not None else []
        return {**generation, "messages": [*instructions, *history, *own[len(instructions):]],
                "previous_response_id": previous_id, "history_messages": len(history)}

    async def _turns_of(self, identity: Identity, previous_id: str
                        ) -> tuple[Generation, list[dict[str, Any]]]:
        """The request a previous response answered, as the log holds it, and its
        output items: a direct response's answer read from the reply log, a
        background one's from its job's last state."""
        found = await _background(self.background, identity, previous_id)
        if found is not None:
            if found["status"] not in ("completed", "incomplete"):
                raise InvalidRequest(
                    f"Previous response '{previous_id}' is {found['status']}: only a "
                    "response that has ended with an answer can be continued.",
                    param="previous_response_id")
            job = await self._job_request(identity, found)
            if job is None:
                raise PreviousResponseNotFound(previous_id)
            return job.generation, list(found["output"])
        try:
            where = await self.stored.find(identity, response_request_id(previous_id),
                                           "responses")
        except ResponseNotFound:
            where = None
        if where is None:
            raise PreviousResponseNotFound(previous_id)
        try:
            folded, _ = await self.stored.read(where)
        except RequestError as exc:
            raise InvalidRequest(f"Previous response '{previous_id}' failed ({exc.message}): "
                                 "it cannot be continued.",
                                 param="previous_response_id") from None
        return where.generation, output_items(
            previous_id, folded.text, recorded_request(where.generation).reads_calls(),
            "completed")

    async def _job_request(self, identity: Identity, background: dict[str, Any]
                           ) -> Recorded | None:
        """The request a background response of the caller's (its object)
        wrote to the log: its job's, keyed by the response's id, written once
        it was created."""
        where = await self.stored.locate(background["id"], of_job=True,
                                         since_ms=background["created_at"] * 1000)
        return where if where is not None and self.stored.mine(where, identity) else None

    async def retrieve(self, response_id: str, request: Request, stream: bool,
                       starting_after: str | None) -> Response:
        """A background response or a stored one (without ``stream``), or a
        response's events after ``starting_after`` (all without it), from the log
        then live (``stream``)."""
        identity = identity_of(request)
        if not stream:
            found = await _background(self.background, identity, response_id)
            if found is not None:
                return SafeJSONResponse(found)
            response_request_id(response_id)  # 404 for what is no response id, before the log
            return SafeJSONResponse(await self.stored_response(identity, response_id))
        rid = response_request_id(response_id)
        after = sequence_after(starting_after)
        events = await self.resume(identity, response_id, after)
        return sse.EventStream(events, headers={**sse.HEADERS, "x-request-id": rid})

    async def collect(self, generation: Generation, answer: Answer, body: ResponsesRequest,
                      disconnected: Disconnected) -> dict[str, Any]:
        """The whole answer as one Response object ({} when the client left first)."""
        try:
            folded = await answer.fold(disconnected)
        except RequestError as exc:
            raise translated(exc, body) from None
        if folded is None:
            return {}
        return _completed(new_response_id(answer.request_id), generation["created"], body,
                          folded, None)

    async def first(self, answer: Answer, body: ResponsesRequest,
                    disconnected: Disconnected) -> Reply | None:
        """The first reply, before the status is chosen (None: the client left)."""
        try:
            return await answer.first(disconnected)
        except RequestError as exc:
            raise translated(exc, body) from None

    def stream(self, generation: Generation, answer: Answer, body: ResponsesRequest,
               first: Reply) -> AsyncIterator[bytes]:
        """SSE frames of the Responses API's events, keep-alive comments while waiting
        (:meth:`gateway.answer.Answer.relay` says what leaving early does)."""
        gateway = self.settings.gateway
        return answer.relay(_sse(response_events(answer, first, body, generation["created"],
                                                 gateway.sse_keepalive_s)), gateway)

    async def resume(self, identity: Identity, response_id: str, after: int
                     ) -> AsyncIterator[bytes]:
        """The SSE events of a response numbered above ``after`` (-1: all), from the
        log then live; 404 when it is not the caller's, 400 for a background one."""
        rid = response_request_id(response_id)
        where = await self.stored.locate(rid)
        if where is None:
            if await _background(self.background, identity, response_id) is not None:
                raise InvalidRequest(
                    f"Response '{response_id}' is a background response, which cannot be "
                    "streamed: it runs as a job whose replies are kept as its result, not "
                    "in the reply log streams are read from. Retrieve it without "
                    f"stream=true (GET /v1/responses/{response_id}) until its status is "
                    "final.", param="stream")
            raise ResponseNotFound(response_id)
        if where.kind != "chat" or not self.stored.mine(where, identity):
            raise ResponseNotFound(response_id)
        return resumed_events(self.settings, self.stored.codec, self.submitter.cancels, where,
                              after, self._framer(where))

    def _framer(self, where: Recorded) -> Framer:
        generation = where.generation
        body = recorded_request(generation)
        keepalive_s = self.settings.gateway.sse_keepalive_s

        def frames(replies: RecordedReplies, after: int) -> AsyncIterator[bytes]:
            def completed_at() -> int:
                ended_ms = replies.ended_ms
                return ended_ms // 1000 if ended_ms is not None else int(time.time())

            return _sse(response_events(replies, None, body, generation["created"], keepalive_s,
                                        completed_at), after)

        return frames

    async def input_items(self, identity: Identity, response_id: str, *, limit: int,
                          order: Literal["asc", "desc"], after: str | None) -> dict[str, Any]:
        """A stored response's own input items (:func:`input_items`), one page;
        404 when it was not stored or is not the caller's."""
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit must be between 1 and 100.", param="limit")
        rid = response_request_id(response_id)
        found = await _background(self.background, identity, response_id)
        where = await self._job_request(identity, found) if found is not None \
            else await self.stored.find(identity, rid, "responses")
        if where is None:
            raise ResponseNotFound(response_id)
        generation = where.generation
        messages = generation["messages"]
        told = len(messages) > 1 and messages[0]["role"] == "system"
        own = messages[told + generation.get("history_messages", 0):]
        return item_page(input_items(rid, own), limit=limit, order=order, after=after)

    async def stored_response(self, identity: Identity, response_id: str) -> dict[str, Any]:
        """A direct (not background) response that was stored, rebuilt from the log
        (gateway/stored.py); 404 when it was not stored or is not the caller's."""
        rid = response_request_id(response_id)
        where = await self.stored.find(identity, rid, "responses")
        if where is None:
            raise ResponseNotFound(response_id)
        generation = where.generation
        body = recorded_request(generation)
        try:
            folded, ended_ms = await self.stored.read(where)
        except RequestError as exc:
            return response_object(response_id, generation["created"], body, "failed",
                                   error=error_info(translated(exc, body)))
        return _completed(response_id, generation["created"], body, folded, ended_ms)


def _completed(response_id: str, created: int, body: ResponsesRequest, folded: Folded,
               ended_ms: int | None) -> dict[str, Any]:
    """The Response object of a whole answer, which ended at ``ended_ms`` (None: now)."""
    return response_object(
        response_id, created, body, "completed", text=folded.text, usage=folded.usage,
        finish_reason=folded.finish_reason,
        completed_at=ended_ms // 1000 if ended_ms is not None else int(time.time()),
        logprobs=chat_logprobs(folded.logprobs)["content"] if body.logprobs_asked()[0]
        else None)


async def _background(background: BackgroundResponses | None, identity: Identity,
                      response_id: str) -> dict[str, Any] | None:
    """The caller's background response ``response_id``; None when there is none."""
    if background is None:
        return None
    try:
        return await background.retrieve(identity, response_id)
    except RequestError as exc:
        if exc.status == 404:
            return None
        raise
