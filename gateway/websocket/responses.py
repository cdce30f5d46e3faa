"""OpenAI's Responses API in WebSocket mode (``ws /v1/responses``): each
``response.create`` validated as over HTTP and answered with the stream's
events, one message each; one response at a time, at most :data:`MAX_QUEUED`
waiting. A refusal before the stream is an ``error`` event with the HTTP status."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from starlette.requests import HTTPConnection

from conveyor.errors import InvalidRequest, RateLimited, RequestError
from gateway.answer import Answer
from gateway.auth.middleware import identity_of
from gateway.errors import for_client
from gateway.responses.serving import (
    ResponsesServing,
    generation_of,
    response_events,
    translated,
)
from gateway.websocket.protocol import (
    Connection,
    ResponseCreate,
    encode,
    parse_response_create,
    response_error_event,
)
from schemas.openai.responses import ResponsesRequest, parse_request

__all__ = ["MAX_QUEUED", "ResponsesSession"]

log = logging.getLogger(__name__)

MAX_QUEUED = 8


class ResponsesSession:
    """The responses of one connection; :meth:`run` lasts as long as the connection."""

    def __init__(self, connection: Connection, responses: ResponsesServing,
                 request: HTTPConnection) -> None:
        self.connection = connection
        self.responses = responses  # a continued response's conversation, from the log
        self.submitter = responses.submitter
        self.request = request
        self.queue: asyncio.Queue[ResponseCreate] = asyncio.Queue(MAX_QUEUED)

    async def run(self) -> None:
        worker = asyncio.create_task(self._work(), name="ws-responses")
        try:
            await self._read()
        finally:
            worker.cancel()
            try:
                await worker
            except asyncio.CancelledError:
                pass
            except Exception as exc:
                log.error("websocket responses failed", exc_info=exc)

    async def _read(self) -> None:
        while True:
            create = await self.connection.next_message(parse_response_create)
            if create is None:
                return
            try:
                self.queue.put_nowait(create)
            except asyncio.QueueFull:
                await self._send_error(RateLimited(
                    f"at most {MAX_QUEUED} responses may wait on one connection; wait for "
                    "one to end", code="too_many_in_flight"))

    async def _work(self) -> None:
        while True:
            create = await self.queue.get()
            try:
                await self._respond(create)
            except Exception as exc:
                await self._send_error(for_client(exc, "websocket response"))

    async def _send_error(self, exc: RequestError) -> None:
        await self.connection.send(encode(response_error_event(exc)))

    async def _respond(self, create: ResponseCreate) -> None:
        if create.fields.get("background"):
            raise InvalidRequest("background responses are not supported over a "
                                 "WebSocket", param="background")
        body = parse_request(json.dumps(create.fields).encode())
        generation = generation_of(body)
        if body.previous_response_id is not None:
            generation = await self.responses.continued(identity_of(self.request), body,
                                                        generation)
        try:
            answer = await self.submitter.admit_and_submit(generation, self.request)
        except RequestError as exc:
            raise translated(exc, body) from None
        try:
            await self._stream(answer, body, generation["created"])
        finally:
            answer.close("client disconnected")

    async def _stream(self, answer: Answer, body: ResponsesRequest, created: int) -> None:
        try:
            first = await answer.next()
        except RequestError as exc:  # before the stream began: an error event
            raise translated(exc, body) from None
        # no ``within``: a reply, the end or a failure, never a keep-alive wait
        async with contextlib.aclosing(response_events(answer, first, body, created,
                                                       within=None)) as stream:
            async for event in stream:
                if event is not None:
                    await self.connection.send(encode(event))
