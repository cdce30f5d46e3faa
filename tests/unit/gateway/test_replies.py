"""What an error reply of the pipeline answers the client with, and how the
reader of a request's replies waits for them."""

from __future__ import annotations

import asyncio
import time

import pytest

from conveyor.errors import DeadlineExceeded
from gateway.replies import RETRY_AFTER_S, ReplyStream, reply_error
from schemas.records import ErrorInfo, Reply


def error_reply(status: int, code: str) -> Reply:
    error = ErrorInfo(status=status, type="service_unavailable", code=code, param=None,
                      message="m")
    return {"error": error}  # type: ignore[typeddict-item]


def test_a_503_of_the_pipeline_says_when_to_retry() -> None:
    for code in ("server_overloaded", "no_worker_available", "pipeline_unavailable"):
        exc = reply_error(error_reply(503, code))
        assert exc.status == 503 and exc.code == code
        assert exc.headers == {"Retry-After": str(RETRY_AFTER_S)}
    assert reply_error(error_reply(400, "context_length_exceeded")).headers == {}


# -- ReplyStream.next: the one reader of a request's replies ------------------

def _reply(index: int) -> Reply:
    return {"index": index}  # type: ignore[typeddict-item]


async def test_a_reply_already_there_is_returned_at_once_and_in_index_order() -> None:
    stream = ReplyStream("r1")
    stream.put(_reply(1))  # early: waits for 0
    stream.put(_reply(0))
    far = time.monotonic() + 60
    assert [(await stream.next(far))["index"] for _ in range(2)] == [0, 1]  # type: ignore[index]


async def test_a_reply_put_while_the_reader_waits_wakes_it() -> None:
    stream = ReplyStream("r1")
    reading = asyncio.create_task(stream.next(time.monotonic() + 60, within=30))
    await asyncio.sleep(0.01)
    stream.put(_reply(1))  # not the next one: the reader keeps waiting
    await asyncio.sleep(0.01)
    assert not reading.done()
    stream.put(_reply(0))
    assert (await asyncio.wait_for(reading, 1))["index"] == 0  # type: ignore[index]
    assert (await stream.next(time.monotonic() + 60))["index"] == 1  # type: ignore[index]


async def test_within_passing_is_none_and_the_deadline_passing_is_a_504() -> None:
    stream = ReplyStream("r1")
    assert await stream.next(time.monotonic() + 60, within=0.01) is None
    with pytest.raises(DeadlineExceeded):
        await stream.next(time.monotonic() + 0.01)
    with pytest.raises(DeadlineExceeded):
        await stream.next(time.monotonic() - 1)
    stream.put(_reply(0))  # a wait that ended leaves nothing behind: the next read has it
    assert (await stream.next(time.monotonic() + 60, within=0.01))["index"] == 0  # type: ignore[index]


async def test_a_reader_cancelled_while_waiting_leaves_the_stream_usable() -> None:
    stream = ReplyStream("r1")
    reading = asyncio.create_task(stream.next(time.monotonic() + 60))
    await asyncio.sleep(0.01)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    stream.put(_reply(0))
    assert (await stream.next(time.monotonic() + 60))["index"] == 0  # type: ignore[index]
