"""Serving chat completions and completions: a generation admitted and submitted,
answered from its replies as JSON or SSE; a stream resumed from the log; a
stored chat completion read back (docs/api/chat.md, docs/api/streams.md).

``n`` > 1: each choice is a request of its own (seeded with seed + i); the
answer's ``id`` is the first choice's and ``usage`` counts the prompt once. A
stream interleaves the choices' chunks by ``index`` and is not resumable; one
choice failing, or the client leaving, ends them all. A stream starts only
with the first reply, so an early failure gets its real status."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from conveyor.errors import InvalidRequest, RequestError
from conveyor.registry import Registry
from conveyor.settings import Settings
from gateway import sse
from gateway.answer import Answer, Disconnected, collect
from gateway.auth.middleware import identity_of
from gateway.errors import SafeJSONResponse, for_client
from gateway.images import ImageIntake
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
from schemas.openai.requests import MAX_INT64, MIN_INT64, ChatCompletionRequest, CompletionRequest
from schemas.records import Generation, Reply

__all__ = ["ChatServing", "answered_by", "choice_generations", "merged_response"]


class ChatServing:
    """``/v1/chat/completions`` and ``/v1/completions``: what their routes dispatch to."""

    def __init__(self, settings: Settings, submitter: Submitter, stored: StoredAnswers,
                 registry: Registry, images: ImageIntake) -> None:
        self.settings = settings
        self.images = images  # a chat's image parts, stored before it is submitted
        self.submitter = submitter  # and its cancels, which a resumed stream's leaving sends
        self.stored = stored
        self.registry = registry  # names a fallback or a canary's deployment

    async def create(self, body: ChatCompletionRequest | CompletionRequest,
                     request: Request) -> Response:
        """A chat completion or a completion (``n`` choices of it), as JSON or SSE."""
        n = body.choices()
        one = body.model_copy(update={"n": 1}) if n > 1 else body
        if isinstance(one, ChatCompletionRequest):
            images = await self.images.refs(one, identity_of(request))
            generation = chat_generation(one, images)
        else:
            generation = completion_generation(one)
        if n > 1 and body.store:  # completions refuse store=true in their validation
            raise InvalidRequest("store=true is supported with n=1 only.", param="n")
        return await self._answer(generation, n, request)

    async def _answer(self, generation: Generation, n: int, request: Request) -> Response:
        """Admit and submit each choice, then answer as JSON or SSE; the first
        admission's ``x-ratelimit-*`` headers, its ``x-request-id`` (what inspect and
        the log know it by) and the model that answered go on the response."""
        generations = choice_generations(generation, n)
        answers: list[Answer] = []
        try:
            for each in generations:
                answers.append(await self.submitter.admit_and_submit(each, request))
            headers = {**answers[0].ticket.headers, "x-request-id": answers[0].request_id}
            if not generation["stream"]:
                result = await _collect_choices(generations, answers, request.is_disconnected)
                return SafeJSONResponse(result, headers={
                    **headers, **answers[0].cache_headers,
                    **answered_by(self.registry, generation["model"], result.get("model"))})
            firsts = []
            for answer in answers:
                first = await answer.first(request.is_disconnected)
                if first is None:  # the client left: nobody reads a status
                    raise _ClientLeft
                firsts.append(first)
        except BaseException as exc:
            for answer in answers:
                answer.close("another choice failed, or the client left")
            if isinstance(exc, _ClientLeft):
                return Response(status_code=499)
            if isinstance(exc, RequestError) and answers:
                # submitted, then refused: the error names the request as its answer would
                exc.headers = {**answers[0].ticket.headers,
                               "x-request-id": answers[0].request_id, **exc.headers}
            raise
        frames = self.stream(answers[0], firsts[0]) if n == 1 else _stream_choices(
            answers, firsts, self.settings.gateway.sse_keepalive_s, generation["include_usage"])
        return sse.EventStream(frames, headers={
            **sse.HEADERS, **headers, **answers[0].cache_headers,
            **answered_by(self.registry, generation["model"], opening(firsts[0]).get("model"))})

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
        events = resumed_events(self.settings, self.stored.codec, self.submitter.cancels, where,
                                after, lambda replies, after: self.frames(replies, None, after))
        return sse.EventStream(events, headers={**sse.HEADERS, "x-request-id": rid})


def answered_by(registry: Registry, asked: str, answered: object) -> dict[str, str]:
    """``x-conveyor-deployment: <model>`` when a canary's deployment of the model
    ``asked`` for answered, ``x-conveyor-fallback: <model>`` when a fallback
    model did (``answered``: the model the answer names); ``x-conveyor-route:
    <model>`` when an alias that routes by meaning sent it to that model."""
    if not isinstance(answered, str) or not answered or answered == asked:
        return {}
    spec = registry.find(asked)
    if spec is not None and answered in dict(spec.deployments):
        return {"x-conveyor-deployment": answered}
    if spec is not None and spec.routes and answered in {
            getattr(registry.find(n), "name", n) for n in (spec.default,
                                                            *(r.model for r in spec.routes))}:
        return {"x-conveyor-route": answered}
    return {"x-conveyor-fallback": answered}


def choice_generations(generation: Generation, n: int) -> list[Generation]:
    """The generation of each choice: the same, but for a seed, which is the
    request's plus the choice's index (kept within Avro's long)."""
    out: list[Generation] = []
    seed = generation["sampling"]["seed"]
    for i in range(n):
        sampling = dict(generation["sampling"])
        if seed is not None:
            sampling["seed"] = (seed + i - MIN_INT64) % (MAX_INT64 - MIN_INT64 + 1) + MIN_INT64
        out.append({**generation, "sampling": sampling})  # type: ignore[typeddict-item]
    return out


def merged_response(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer of the choices' answers (see the module)."""
    choices = [{**r["choices"][0], "index": i} for i, r in enumerate(results)]
    return {**results[0], "choices": choices, "usage": _summed([r["usage"] for r in results])}


def _summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The first choice's usage with every choice's completion tokens."""
    completion = sum(u["completion_tokens"] for u in usages)
    return {**usages[0], "completion_tokens": completion,
            "total_tokens": usages[0]["prompt_tokens"] + completion}


class _ClientLeft(Exception):
    """The client went away before every choice's first reply."""


async def _collect_choices(generations: list[Generation], answers: list[Answer],
                           disconnected: Disconnected) -> dict[str, Any]:
    """Every choice's whole answer, as one ({} when the client left first)."""
    tasks = [asyncio.create_task(collect(g, a, disconnected))
             for g, a in zip(generations, answers, strict=True)]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for answer in answers:
            answer.close("another choice failed, or the client left")
    if any(not r for r in results):
        return {}
    return merged_response(results)


async def _stream_choices(answers: list[Answer], firsts: list[Reply], keepalive_s: float,
                         include_usage: bool) -> AsyncIterator[bytes]:
    """SSE frames of every choice's chunks, each with its index, then the usage
    and ``[DONE]`` (see the module); keep-alive comments while none comes."""
    queue: asyncio.Queue[tuple[int, Reply | BaseException]] = asyncio.Queue()

    async def pump(i: int, answer: Answer, first: Reply) -> None:
        reply: Reply | None = first
        while True:
            if reply is not None:
                await queue.put((i, reply))
                if reply["kind"] == "final":
                    return
            try:
                reply = await answer.next(within=keepalive_s)
            except Exception as exc:  # an error reply, or the pipeline's failure
                await queue.put((i, exc))
                return

    primary = answers[0].request_id
    pumps = [asyncio.create_task(pump(i, a, f))
             for i, (a, f) in enumerate(zip(answers, firsts, strict=True))]
    usages: list[dict[str, Any]] = []
    base: dict[str, Any] = {}
    open_choices = len(answers)
    try:
        while open_choices:
            try:
                i, item = await asyncio.wait_for(queue.get(), keepalive_s)
            except TimeoutError:
                yield sse.comment()
                continue
            if isinstance(item, BaseException):
                yield sse.json_data(for_client(item, f"choice {i} of {primary}").envelope())
                yield sse.Last(sse.DONE)
                return
            for line in item["chunk"].split("\n") if item["chunk"] else ():
                chunk = json.loads(line)
                if not chunk.get("choices") and chunk.get("usage"):
                    usages.append(chunk["usage"])
                    continue
                base = base or chunk
                chunk["id"] = base["id"]
                for choice in chunk.get("choices") or ():
                    choice["index"] = i
                yield sse.json_data(chunk)
            if item["kind"] == "final":
                open_choices -= 1
        if include_usage and usages:
            yield sse.json_data({**{k: base[k] for k in ("id", "object", "created", "model")
                                 if k in base}, "choices": [], "usage": _summed(usages)})
        yield sse.Last(sse.DONE)
    finally:
        for task in pumps:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for answer in answers:
            answer.close(f"the stream of {primary}'s choices ended or its client left")

