"""SSE framing and the event-stream response: a stream's last frame and the end
of the body go out in one ASGI message (one socket write), and the stream's own
ending runs before it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from starlette.types import Send

from gateway import sse


async def _sent(frames: AsyncIterator[bytes]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        messages.append(dict(message))

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    await sse.EventStream(frames)(scope, receive, send)
    return messages


def _bodies(messages: list[dict[str, Any]]) -> list[tuple[bytes, bool]]:
    return [(m["body"], m["more_body"]) for m in messages if m["type"] == "http.response.body"]


async def test_the_last_frame_ends_the_body_in_the_same_message() -> None:
    ended: list[str] = []

    async def frames() -> AsyncIterator[bytes]:
        try:
            yield sse.data('{"a":1}')
            yield sse.Last(sse.data('{"b":2}') + sse.DONE)
        finally:
            ended.append("stream")

    messages = await _sent(frames())
    assert messages[0]["type"] == "http.response.start"
    assert (b"content-type", b"text/event-stream; charset=utf-8") in messages[0]["headers"]
    assert _bodies(messages) == [(b'data: {"a":1}\n\n', True),
                                 (b'data: {"b":2}\n\n' + sse.DONE, False)]
    assert ended == ["stream"]  # the iterator ran to its end, not closed half-way


async def test_a_stream_without_a_last_frame_ends_with_an_empty_body() -> None:
    async def frames() -> AsyncIterator[bytes]:
        yield sse.comment()
        yield sse.DONE

    assert _bodies(await _sent(frames())) == [(b": keep-alive\n", True), (sse.DONE, True),
                                              (b"", False)]


async def test_a_frame_after_the_last_one_is_still_sent_in_order() -> None:
    async def frames() -> AsyncIterator[bytes]:
        yield sse.Last(b"x")
        yield b"y"

    assert _bodies(await _sent(frames())) == [(b"x", True), (b"y", True), (b"", False)]


# -- a server of ASGI spec 2.3 (uvicorn): the disconnect is read from receive --

_SPEC_23 = {"type": "http", "asgi": {"spec_version": "2.3"}}


class _Client:
    """``receive`` as a server gives it once the body was read: it waits until
    the client goes away."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.messages: list[dict[str, Any]] = []

    async def receive(self) -> Any:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Any) -> None:
        self.messages.append(dict(message))


async def test_a_whole_stream_leaves_no_task_behind_on_a_23_server() -> None:
    client = _Client()

    async def frames() -> AsyncIterator[bytes]:
        yield sse.data('{"a":1}')
        yield sse.Last(sse.DONE)

    before = asyncio.all_tasks()
    await sse.EventStream(frames())(_SPEC_23, client.receive, client.send)
    assert _bodies(client.messages) == [(b'data: {"a":1}\n\n', True), (sse.DONE, False)]
    await asyncio.sleep(0)  # the watcher's cancellation runs
    assert asyncio.all_tasks() == before


async def _frames(ended: list[str], between: Callable[[], Awaitable[None]]
                  ) -> AsyncIterator[bytes]:
    """Two frames with ``between`` awaited after the first; ``ended`` says
    whether the iterator's ``finally`` ran."""
    try:
        yield sse.data('{"a":1}')
        await between()
        yield b"more"
    finally:
        ended.append("stream")


async def _leave_when(moment: asyncio.Event, frames: AsyncIterator[bytes],
                      client: _Client, send: Send | None = None) -> None:
    """Stream on a 2.3 server; the client leaves at ``moment``. The stream must
    then end by itself, without an error."""
    streaming = asyncio.create_task(
        sse.EventStream(frames)(_SPEC_23, client.receive, send or client.send))
    await moment.wait()
    client.gone.set()
    await asyncio.wait_for(streaming, 5)


async def test_a_client_that_leaves_while_the_stream_waits_closes_it() -> None:
    client, waiting = _Client(), asyncio.Event()
    ended: list[str] = []

    async def no_next_reply() -> None:
        waiting.set()
        await asyncio.Event().wait()

    await _leave_when(waiting, _frames(ended, no_next_reply), client)
    assert ended == ["stream"]
    assert _bodies(client.messages) == [(b'data: {"a":1}\n\n', True)]


async def test_a_client_that_leaves_while_a_send_waits_closes_the_stream() -> None:
    client, stuck = _Client(), asyncio.Event()
    ended: list[str] = []

    async def nothing() -> None:
        pass

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body":
            stuck.set()
            await asyncio.Event().wait()  # a client that reads nothing: the write waits

    await _leave_when(stuck, _frames(ended, nothing), client, send)
    assert ended == ["stream"]


async def test_a_stream_cancelled_from_elsewhere_is_cancelled() -> None:
    client = _Client()
    started = asyncio.Event()

    async def frames() -> AsyncIterator[bytes]:
        started.set()
        await asyncio.Event().wait()
        yield b"never"

    streaming = asyncio.create_task(
        sse.EventStream(frames())(_SPEC_23, client.receive, client.send))
    await started.wait()
    streaming.cancel()  # a server shutting down, say: not the client leaving
    with pytest.raises(asyncio.CancelledError):
        await streaming
