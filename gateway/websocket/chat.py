"""Several chat (or completion) generations on one WebSocket, each under its
client's id, admitted and submitted as over HTTP and always streamed. At most
:data:`MAX_IN_FLIGHT` at once (then 429; an id in flight: 400); ``cancel`` ends
one (once it is submitted), the connection closing ends them all."""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any

from pydantic import ValidationError
from starlette.requests import HTTPConnection

from conveyor.errors import InvalidRequest, RateLimited, RequestError
from gateway.answer import Answer
from gateway.errors import for_client
from gateway.submission import Submitter
from gateway.websocket.protocol import (
    INTERNAL_ERROR,
    CancelMessage,
    Connection,
    Endpoint,
    RequestMessage,
    chunk_frame,
    done_message,
    encode,
    error_message,
    parse_multiplexed,
)
from schemas import records
from schemas.openai.generations import chat_generation, completion_generation
from schemas.openai.requests import ChatCompletionRequest, CompletionRequest, invalid_request

__all__ = ["MAX_IN_FLIGHT", "GenerationState", "Generation", "Multiplexer", "validated"]

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 32

_CANCELLED = RequestError("The request was cancelled by the client.", status=499,
                          type="cancelled", code="request_cancelled")


class _ClientCancelled(Exception):
    """The client cancelled a request while it was being submitted."""


class GenerationState(enum.Enum):
    SUBMITTING = "submitting"  # validated, admitted and produced: not yet cancellable
    STREAMING = "streaming"
    ENDED = "ended"


_ALLOWED = {
    GenerationState.SUBMITTING: {GenerationState.STREAMING, GenerationState.ENDED},
    GenerationState.STREAMING: {GenerationState.ENDED},
    GenerationState.ENDED: set(),
}


def validated(endpoint: Endpoint, body: Any) -> records.Generation:
    """The generation a request body asks for; :class:`InvalidRequest` naming the
    ``param`` as the HTTP route would."""
    model: type[ChatCompletionRequest] | type[CompletionRequest] = (
        ChatCompletionRequest if endpoint == "chat" else CompletionRequest)
    if not isinstance(body, dict):
        raise InvalidRequest("The request's body must be a JSON object.", param="body")
    try:
        parsed = model.model_validate({**body, "stream": True})
    except ValidationError as exc:  # worded as over HTTP
        raise invalid_request(exc.errors()) from None
    return (chat_generation(parsed) if isinstance(parsed, ChatCompletionRequest)
            else completion_generation(parsed))


class Generation:
    """One request of the connection, from its first message to its last."""

    def __init__(self, rid: str, connection: Connection) -> None:
        self.id = rid
        self.connection = connection
        self.state = GenerationState.SUBMITTING
        self.cancel_requested = False
        self.answer: Answer | None = None
        self.task: asyncio.Task[None] | None = None

    def _move(self, to: GenerationState) -> None:
        if to not in _ALLOWED[self.state]:
            raise RuntimeError(f"request {self.id} cannot go from {self.state.value} "
                               f"to {to.value}")
        self.state = to

    def cancel(self) -> None:
        """Stop this generation: at once while it streams, or as soon as it is submitted."""
        self.cancel_requested = True
        if self.state is GenerationState.STREAMING and self.task is not None:
            self.task.cancel()

    async def run(self, submitter: Submitter, request: HTTPConnection, endpoint: Endpoint,
                  body: Any) -> None:
        """Serve the request to its one terminal message. A task cancelled by
        anything but the client's ``cancel`` (the connection is over) stays
        cancelled."""
        try:
            await self._serve(submitter, request, endpoint, body)
        except asyncio.CancelledError:
            if not self.cancel_requested or not self.connection.open:
                raise
            await self._end(error_message(self.id, _CANCELLED))
        except _ClientCancelled:
            await self._end(error_message(self.id, _CANCELLED))
        except Exception as exc:
            await self._end(error_message(self.id, for_client(exc, f"websocket request {self.id}")))
        finally:
            if self.answer is not None:
                self.answer.close("client cancelled" if self.cancel_requested
                                  else "client disconnected")
            if self.state is not GenerationState.ENDED:
                self._move(GenerationState.ENDED)

    async def _serve(self, submitter: Submitter, request: HTTPConnection, endpoint: Endpoint,
                     body: Any) -> None:
        generation = validated(endpoint, body)
        self.answer = await submitter.admit_and_submit(generation, request)
        self._move(GenerationState.STREAMING)
        if self.cancel_requested:
            raise _ClientCancelled
        while True:
            reply = await self.answer.next()
            assert reply is not None  # no ``within``: a reply or an exception
            for line in reply["chunk"].split("\n") if reply["chunk"] else ():
                await self.connection.send(chunk_frame(self.id, line))
            if reply["kind"] == "final":
                await self._end(done_message(self.id))
                return

    async def _end(self, message: dict[str, Any]) -> None:
        """The one terminal message of this request; nothing of it is sent after."""
        if self.state is GenerationState.ENDED:
            return
        self._move(GenerationState.ENDED)
        await self.connection.send(encode(message))


class Multiplexer:
    """The requests of one connection; :meth:`run` lasts as long as the connection."""

    def __init__(self, connection: Connection, submitter: Submitter, request: HTTPConnection,
                 endpoint: Endpoint, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.connection = connection
        self.submitter = submitter
        self.request = request  # the handshake (an HTTPConnection): identity, headers
        self.endpoint = endpoint
        self.max_in_flight = max_in_flight
        self.in_flight: dict[str, Generation] = {}

    async def run(self) -> None:
        """Read frames until the client leaves or sends one the protocol cannot take;
        then every generation still running is cancelled."""
        try:
            while True:
                message = await self.connection.next_message(parse_multiplexed)
                if message is None:
                    return
                if isinstance(message, CancelMessage):
                    self._cancel(message)
                else:
                    await self._start(message)
        finally:
            await self._stop_all()

    def _cancel(self, message: CancelMessage) -> None:
        generation = self.in_flight.get(message.id)
        if generation is not None:
            generation.cancel()

    async def _start(self, message: RequestMessage) -> None:
        if message.id in self.in_flight:
            await self.connection.send(encode(error_message(message.id, InvalidRequest(
                f"request id {message.id!r} is already in flight on this connection",
                param="id"))))
            return
        if len(self.in_flight) >= self.max_in_flight:
            await self.connection.send(encode(error_message(message.id, RateLimited(
                f"at most {self.max_in_flight} requests may be in flight on one "
                "connection; wait for one to end", code="too_many_in_flight"))))
            return
        generation = Generation(message.id, self.connection)
        self.in_flight[message.id] = generation
        generation.task = asyncio.create_task(
            generation.run(self.submitter, self.request, self.endpoint, message.body),
            name=f"ws-request-{message.id}")
        generation.task.add_done_callback(lambda _: self._ended(generation))

    def _ended(self, generation: Generation) -> None:
        if self.in_flight.get(generation.id) is generation:
            del self.in_flight[generation.id]

    async def _stop_all(self) -> None:
        """The connection is over: cancel what runs and wait for it to let go (a
        request being produced is cancelled once it is). Closing here is a no-op
        unless the reader itself failed."""
        await self.connection.close(INTERNAL_ERROR, "the gateway stopped serving this "
                                                    "connection")
        generations = list(self.in_flight.values())
        for generation in generations:
            generation.cancel()
        tasks = [g.task for g in generations if g.task is not None]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for generation, result in zip(generations, results, strict=True):
            if isinstance(result, Exception):
                log.error("websocket request %s failed", generation.id, exc_info=result)
