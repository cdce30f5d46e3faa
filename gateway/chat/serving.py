"""Serving chat completions and completions: a generation admitted and
submitted (:class:`~gateway.submission.Submitter`), then answered from its
replies as JSON or SSE; ``n`` > 1 as several requests answered as one
(:mod:`gateway.chat.choices`); a stream resumed from the log; a stored chat
completion read back (:mod:`gateway.stored`).

A stream starts only with the first reply, so a request that fails before it
gets the right status and error envelope. Past ``request_timeout_s`` the
client gets 504 and the generation is cancelled; a client that leaves
cancels it at once before the stream began, else after ``resume_grace_s``
unless a resumed stream reads it (docs/api/streams.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import Response
from starlette.requests import Request

from conveyor.errors import InvalidRequest
from conveyor.registry import Registry
from conveyor.settings import Settings
from gateway import sse
from gateway.answer import Answer, answered_by, collect
from gateway.auth.middleware import identity_of
from gateway.cancels import Cancels
from gateway.chat.choices import answer_choices
from gateway.errors import SafeJSONResponse, for_client
from gateway.replies import ReplySource, opening
from gateway.resume import (
    Kind,
    StreamNotFound,
    event_id,
    request_id_of,
    resume_after,
    resumed_events,
)
from gateway.stored import StoredAnswers
from gateway.submission import Submitter
from schemas.openai.generations import chat_generation, completion_generation
from schemas.openai.requests import ChatCompletionRequest, CompletionRequest
from schemas.records import Generation, Reply

__all__ = ["ChatServing"]


class ChatServing:
    """``/v1/chat/completions`` and ``/v1/completions``: what their routes dispatch to."""

    def __init__(self, settings: Settings, submitter: Submitter, stored: StoredAnswers,
                 cancels: Cancels, registry: Registry) -> None:
        self.settings = settings
        self.submitter = submitter
        self.stored = stored
        self.cancels = cancels
        self.registry = registry  # names a fallback or a canary's deployment

    async def create_chat_completion(self, body: ChatCompletionRequest,
                                     request: Request) -> Response:
        """A chat completion (``n`` choices of it), as JSON or SSE."""
        n = body.choices()
        generation = chat_generation(body.model_copy(update={"n": 1}) if n > 1 else body)
        if n > 1 and body.store:
            raise InvalidRequest("store=true is supported with n=1 only.", param="n")
        return await self._answer(generation, n, request)

    async def create_completion(self, body: CompletionRequest, request: Request) -> Response:
        """A completion (``n`` choices of it), as JSON or SSE."""
        n = body.choices()
        generation = completion_generation(body.model_copy(update={"n": 1}) if n > 1 else body)
        return await self._answer(generation, n, request)

    async def _answer(self, generation: Generation, n: int, request: Request) -> Response:
        """Admit and submit, then answer as JSON or SSE; the admission's
        ``x-ratelimit-*`` headers, the request's ``x-request-id`` (what inspect and
        the log know it by) and the model that answered go on the response."""
        if n > 1:
            return await answer_choices(self.submitter, generation, n, request,
                                        self.settings.gateway.sse_keepalive_s, self.registry)
        answer = await self.submitter.admit_and_submit(generation, request)
        headers = {**answer.ticket.headers, "x-request-id": answer.request_id}
        if not generation["stream"]:
            result = await collect(generation, answer, request.is_disconnected)
            served = answered_by(self.registry, generation["model"], result.get("model"))
            return SafeJSONResponse(result, headers={**headers, **answer.cache_headers, **served})
        first = await answer.first(request.is_disconnected)
        if first is None:  # the client left: nobody reads a status
            return Response(status_code=499)
        served = answered_by(self.registry, generation["model"], opening(first).get("model"))
        return sse.EventStream(self.stream(answer, first), headers={
            **sse.HEADERS, **headers, **answer.cache_headers, **served})

    def stream(self, answer: Answer, first: Reply) -> AsyncIterator[bytes]:
        """SSE frames: OpenAI chunks, keep-alive comments while waiting, then [DONE]
        (:meth:`gateway.answer.Answer.relay` says what leaving early does)."""
        return answer.relay(self.frames(answer, first, after=-1), self.settings.gateway)

    async def frames(self, source: ReplySource, first: Reply | None,
                     after: int) -> AsyncIterator[bytes]:
        """Data events numbered from 0 (``id: {request id}:{seq}``), those after
        ``after`` sent; keep-alive comments while waiting; an error as an event."""
        keepalive = self.settings.gateway.sse_keepalive_s
        rid = source.request_id
        ids = self.settings.gateway.resumable_streams
        seq = -1
        reply: Reply | None = first
        while True:
            if reply is None:
                yield sse.comment()
            else:
                # a reply's events go out in one write: a socket write costs more
                # than the bytes in it (on loopback, the receiver's work too)
                frames = []
                for chunk in reply["chunk"].split("\n") if reply["chunk"] else ():
                    seq += 1
                    if seq > after:
                        frames.append(sse.data(chunk, id=event_id(rid, seq) if ids else None))
                if reply["kind"] == "final":
                    yield sse.Last(b"".join(frames) + sse.DONE)
                    return
                if frames:
                    yield b"".join(frames)
            try:
                reply = await source.next(within=keepalive)
            except Exception as exc:  # the status is sent: the error becomes an event
                seq += 1
                if seq > after:
                    yield sse.json_data(for_client(exc, f"stream {rid}").envelope(),
                                        id=event_id(rid, seq) if ids else None)
                yield sse.Last(sse.DONE)
                return

    async def resume(self, kind: Kind, stream_id: str, request: Request,
                     starting_after: str | None) -> Response:
        """The events of a stream after ``Last-Event-ID`` (or ``?starting_after=N``),
        from the log then live. Only its tenant may read it (404 for others, as for
        a stream that does not exist)."""
        rid = request_id_of(stream_id, kind)
        after = resume_after(rid, request.headers.get("last-event-id"), starting_after)
        where = await self.stored.locate(rid)
        if where is None or where.kind != kind or not self.stored.mine(
                where, identity_of(request)):
            raise StreamNotFound(stream_id)
        events = resumed_events(self.settings, self.stored.codec, self.cancels, where, after,
                                lambda replies, after: self.frames(replies, None, after))
        return sse.EventStream(events, headers={**sse.HEADERS, "x-request-id": rid})

