"""SSE framing and the event-stream response: a stream's last frame and the end
of the body go out in one ASGI message (one socket write), and the stream's own
ending runs before it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

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

    assert _bodies(await _sent(frames())) == [(b": keep-alive\n\n", True), (sse.DONE, True),
                                              (b"", False)]


async def test_a_frame_after_the_last_one_is_still_sent_in_order() -> None:
    async def frames() -> AsyncIterator[bytes]:
        yield sse.Last(b"x")
        yield b"y"

    assert _bodies(await _sent(frames())) == [(b"x", True), (b"y", True), (b"", False)]
