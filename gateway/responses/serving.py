"""Serving a Responses API request through the chat pipeline.

A Responses request becomes a chat :class:`~schemas.records.Generation`:
``instructions`` first as a system message, then the input's messages (a
string input is one user message). It is admitted and submitted as chat
requests are (:func:`gateway.api_router.admit_and_submit`), and answered from
the same replies: collected into one Response object, or streamed as the
Responses API's events (:mod:`gateway.responses.events`). The response id is
``resp_`` and the pipeline's request id, so the log finds it.

As for chat, a stream starts only when the first reply is in: a request that
fails before its first token is an HTTP error in OpenAI's envelope. The
preprocess layer names a faulty message ``messages[k]``; that ``param`` is
translated back to the field the client sent (``instructions`` or
``input[j]``). A failure after the stream began is a ``response.failed``
event. A client that leaves cancels its generation (the stream's iterator is
closed, or the collector sees the disconnect).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from conveyor.errors import RequestError
from gateway import sse
from gateway.responses.events import ResponseEvents, frame
from gateway.responses.objects import new_response_id, response_object
from gateway.responses.protocol import ResponsesRequest
from gateway.serving import Answer, Serving
from schemas.records import ErrorInfo, Generation, Message, Reply, Sampling

__all__ = ["generation_of", "input_param", "collect_response", "first_reply",
           "stream_events"]

log = logging.getLogger(__name__)

Disconnected = Callable[[], Awaitable[bool]]

_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")
_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens"}


def generation_of(body: ResponsesRequest) -> Generation:
    """The chat generation a Responses request asks for."""
    messages = [Message(role=role, content=text, name=None) for role, text in body.messages()]
    sampling = Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=1.0 if body.top_p is None else body.top_p,
                        max_tokens=body.max_output_tokens, stop=[], seed=None,
                        presence_penalty=0.0, frequency_penalty=0.0)
    return Generation(kind="chat", model=body.model, messages=messages, prompt=None,
                      sampling=sampling, stream=bool(body.stream), include_usage=False,
                      created=int(time.time()))


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


def _translated(exc: RequestError, body: ResponsesRequest) -> RequestError:
    exc.param = input_param(exc.param, body)
    return exc


def _error_info(exc: RequestError) -> ErrorInfo:
    return ErrorInfo(status=exc.status, type=exc.type, code=exc.code, param=exc.param,
                     message=exc.message)


async def collect_response(serving: Serving, generation: Generation, answer: Answer,
                           body: ResponsesRequest,
                           disconnected: Disconnected) -> dict[str, Any]:
    """The whole answer as one Response object ({} when the client left first)."""
    try:
        chat = await serving.collect(generation, answer, disconnected)
    except RequestError as exc:
        raise _translated(exc, body) from None
    if not chat:
        return {}
    choice = chat["choices"][0]
    usage = chat["usage"]
    return response_object(new_response_id(answer.request_id), generation["created"], body,
                           "completed", text=choice["message"]["content"],
                           usage={"prompt_tokens": usage["prompt_tokens"],
                                  "completion_tokens": usage["completion_tokens"]},
                           finish_reason=choice["finish_reason"],
                           completed_at=int(time.time()))


async def first_reply(serving: Serving, answer: Answer, body: ResponsesRequest,
                      disconnected: Disconnected) -> Reply | None:
    """The first reply, before the status is chosen (None: the client left)."""
    try:
        return await serving.first(answer, disconnected)
    except RequestError as exc:
        raise _translated(exc, body) from None


async def stream_events(serving: Serving, generation: Generation, answer: Answer,
                        body: ResponsesRequest, first: Reply) -> AsyncIterator[bytes]:
    """SSE frames of the Responses API's events, keep-alive comments while waiting.
    Closing the iterator early (the client went away) cancels the generation."""
    events = ResponseEvents(new_response_id(answer.request_id), generation["created"], body)
    keepalive = serving.settings.sse_keepalive_s
    try:
        for event in events.opening():
            yield frame(event)
        reply: Reply | None = first
        while True:
            if reply is None:
                yield sse.comment()
            else:
                for event in events.delta(reply["text"]):
                    yield frame(event)
                if reply["kind"] == "final":
                    for event in events.closing(reply["finish_reason"], reply["usage"],
                                                int(time.time())):
                        yield frame(event)
                    return
            try:
                reply = await answer.next(within=keepalive)
            except Exception as exc:  # the status is sent: the error becomes an event
                if not isinstance(exc, RequestError):
                    log.error("stream %s failed", answer.request_id, exc_info=exc)
                    exc = RequestError("Internal error.")
                for event in events.failure(_error_info(_translated(exc, body))):
                    yield frame(event)
                return
    finally:
        answer.close("client disconnected")
