"""Serving Anthropic's Messages API through the chat pipeline (docs/api/messages.md):
the request as a chat generation (gateway/messages/protocol.py), admitted and
submitted as chat is (keys, limits, quotas, policies, usage, inspect), answered
from its replies as one Message or as Anthropic's events. The answer is read as
chat reads it: folded whole, its tool calls read by the one reader
(schemas/tool_calls.py), or relayed reply by reply from postprocess's chunks. A
stream starts only with the first reply, so an early failure gets its real
status; a later one is an ``error`` event."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from conveyor.errors import RequestError
from conveyor.registry import Registry
from conveyor.settings import Settings
from gateway import sse
from gateway.answer import Answer
from gateway.chat.serving import answered_by
from gateway.errors import SafeJSONResponse, for_client
from gateway.messages.events import PING, MessageEvents, frame
from gateway.messages.objects import error_of, message_object
from gateway.messages.protocol import Mapped, MessagesRequest, generation_of, translated
from gateway.replies import opening
from gateway.submission import Submitter
from schemas.records import Reply
from schemas.tool_calls import read_tool_calls
from schemas.tools import reads_tool_calls

__all__ = ["MessagesServing"]


class MessagesServing:
    """``POST /v1/messages``: what its route dispatches to."""

    def __init__(self, settings: Settings, submitter: Submitter, registry: Registry) -> None:
        self.settings = settings
        self.submitter = submitter
        self.registry = registry  # names a fallback or a canary's deployment

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        """The Message as JSON, or its events as SSE."""
        mapped = generation_of(body)
        generation = mapped.generation
        try:
            answer = await self.submitter.admit_and_submit(generation, request)
        except RequestError as exc:
            raise translated(exc, mapped.origins) from None
        headers = {**answer.ticket.headers, "x-request-id": answer.request_id,
                   "request-id": answer.request_id}
        try:
            if not generation["stream"]:
                result = await self._collect(mapped, answer, request)
                if not result:  # the client left: nobody reads a status
                    return Response(status_code=499)
                return SafeJSONResponse(result, headers={
                    **headers, **answer.cache_headers,
                    **answered_by(self.registry, generation["model"], result["model"])})
            first = await answer.first(request.is_disconnected)
        except RequestError as exc:
            exc.headers = {**headers, **exc.headers}
            raise translated(exc, mapped.origins) from None
        if first is None:
            return Response(status_code=499)
        model = opening(first).get("model") or generation["model"]
        events = MessageEvents(answer.request_id, model, generation["sampling"]["stop"])
        frames = _sse(self._events(events, answer, first, reads_tool_calls(generation)))
        return sse.EventStream(answer.relay(frames, self.settings.gateway), headers={
            **sse.HEADERS, **headers, **answer.cache_headers,
            **answered_by(self.registry, generation["model"], model)})

    async def _collect(self, mapped: Mapped, answer: Answer, request: Request
                       ) -> dict[str, Any]:
        """The whole answer as one Message ({} when the client left first)."""
        generation = mapped.generation
        folded = await answer.fold(request.is_disconnected)
        if folded is None:
            return {}
        text: str | None = folded.text
        calls: list[dict[str, Any]] = []
        if reads_tool_calls(generation):
            read = read_tool_calls(answer.request_id, folded.text)
            text, calls = read.content, read.tool_calls
        return message_object(answer.request_id, folded.model or generation["model"], text,
                              calls, folded.finish_reason, folded.usage,
                              generation["sampling"]["stop"])

    async def _events(self, events: MessageEvents, answer: Answer, first: Reply,
                      calls: bool) -> AsyncGenerator[dict[str, Any] | None, None]:
        """The Message's events from its replies (their chunks read when the
        answer may hold tool ``calls``, else their text); None for a wait of a
        keep-alive."""
        for event in events.opening():
            yield event
        keepalive = self.settings.gateway.sse_keepalive_s
        reply: Reply | None = first
        while True:
            if reply is None:
                yield None
            else:
                for event in (events.chunks(reply["chunk"]) if calls
                              else events.text(reply["text"])):
                    yield event
                if reply["kind"] == "final":
                    for event in events.closing(reply["finish_reason"], reply["usage"]):
                        yield event
                    return
            try:
                reply = await answer.next(within=keepalive)
            except Exception as exc:  # the status is sent: the error becomes an event
                error = for_client(exc, f"stream {answer.request_id}")
                yield error_of(error.status, error.message, error.param)[1]
                return


_ENDS = frozenset({"message_stop", "error"})


async def _sse(events: AsyncGenerator[dict[str, Any] | None, None]) -> AsyncIterator[bytes]:
    """The events as SSE, a ``ping`` for a wait; the last event is the stream's
    last frame (gateway/sse.py)."""
    async with contextlib.aclosing(events):
        async for event in events:
            if event is None:
                yield frame(PING)
            elif event["type"] in _ENDS:
                yield sse.Last(frame(event))
            else:
                yield frame(event)
