"""``n`` > 1: several choices of one chat completion or completion.

Each choice is a request of its own through the pipeline (choice i seeded
with seed + i); the answer's ``id`` is the first choice's, ``choices[i]`` the
i-th answer, ``usage`` counts the prompt once and every choice's completion.
A stream interleaves the choices' chunks with their ``index``, then the usage
and ``[DONE]``; it carries no event ids (not resumable). One choice failing,
or the client leaving, ends them all. Batches, stored completions and the
WebSocket API take ``n`` = 1 only."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from conveyor.registry import Registry
from gateway import sse
from gateway.answer import Answer, Disconnected, answered_by, collect
from gateway.errors import SafeJSONResponse, for_client
from gateway.replies import opening
from gateway.submission import Submitter
from schemas.openai.requests import MAX_INT64, MIN_INT64
from schemas.records import Generation, Reply

__all__ = ["answer_choices", "choice_generations", "merged_response", "collect_choices",
           "stream_choices"]


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
    first = results[0]
    choices = [{**r["choices"][0], "index": i} for i, r in enumerate(results)]
    completion = sum(r["usage"]["completion_tokens"] for r in results)
    usage = {**first["usage"], "completion_tokens": completion,
             "total_tokens": first["usage"]["prompt_tokens"] + completion}
    return {**first, "choices": choices, "usage": usage}


async def answer_choices(submitter: Submitter, generation: Generation, n: int,
                         request: Request, keepalive_s: float, registry: Registry) -> Response:
    """``n`` choices of ``generation``, each admitted and submitted, answered as one
    (see the module)."""
    generations = choice_generations(generation, n)
    answers: list[Answer] = []
    try:
        for each in generations:
            answers.append(await submitter.admit_and_submit(each, request))
        headers = {**answers[0].ticket.headers, "x-request-id": answers[0].request_id}
        if not generation["stream"]:
            result = await collect_choices(generations, answers, request.is_disconnected)
            return SafeJSONResponse(result, headers={
                **headers, **answered_by(registry, generation["model"], result.get("model"))})
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
        raise
    return sse.EventStream(
        stream_choices(answers, firsts, keepalive_s, generation["include_usage"]),
        headers={**sse.HEADERS, **headers,
                 **answered_by(registry, generation["model"],
                                  opening(firsts[0]).get("model"))})


class _ClientLeft(Exception):
    """The client went away before every choice's first reply."""


async def collect_choices(generations: list[Generation], answers: list[Answer],
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


async def stream_choices(answers: list[Answer], firsts: list[Reply], keepalive_s: float,
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
            completion = sum(u["completion_tokens"] for u in usages)
            usage = {**usages[0], "completion_tokens": completion,
                     "total_tokens": usages[0]["prompt_tokens"] + completion}
            yield sse.json_data({**{k: base[k] for k in ("id", "object", "created", "model")
                                 if k in base}, "choices": [], "usage": usage})
        yield sse.Last(sse.DONE)
    finally:
        for task in pumps:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for answer in answers:
            answer.close(f"the stream of {primary}'s choices ended or its client left")

