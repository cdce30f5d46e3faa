"""ChatServing.stream: SSE framing, keep-alive comments, cancel on early close,
deadline; an answer's first reply and its access-log line.

These run with ``resume_grace_s=0``: the cancel of a stream closed early is
then sent at once, as before streams could be resumed; the grace itself is
tested in tests/kafka/gateway/test_resume.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from openai._streaming import SSEDecoder

from conveyor.settings import load_settings
from gateway import sse
from gateway.answer import Answer
from gateway.chat.serving import ChatServing
from gateway.replies import ReplyStream
from schemas.codec import default_codec
from schemas.records import Reply
from tests.support.gateway_fakes import RecordingProducer, Router, chat_serving
from topics.envelope import new_envelope


def reply(index: int, kind: str, chunks: list[dict[str, Any]] | None = None) -> Reply:
    return Reply(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                 index=index, kind=kind,  # type: ignore[typeddict-item]
                 text="", chunk="\n".join(json.dumps(c) for c in chunks or []),
                 finish_reason=None, usage=None, error=None)


def setup(keepalive: float = 0.05, deadline_s: float = 5.0, grace_s: float = 0,
          resumable: bool = True) -> tuple[ChatServing, Answer, RecordingProducer]:
    producer = RecordingProducer()
    settings = load_settings(topic_prefix="sv", sse_keepalive_s=keepalive, resume_grace_s=grace_s,
                        resumable_streams=resumable)
    serving = chat_serving(settings, producer)
    answer = Answer(ReplyStream("r1"), time.monotonic() + deadline_s,
                    Router(), serving.submitter.cancels)  # type: ignore[arg-type]
    return serving, answer, producer


async def test_frames_keepalives_and_done() -> None:
    serving, answer, _ = setup()

    async def later() -> None:
        await asyncio.sleep(0.2)
        answer.stream.put(reply(1, "final", [{"b": 2}, {"c": 3}]))

    answer.stream.put(reply(0, "delta", [{"a": 1}]))
    first = await answer.first(still_here)
    assert first is not None
    feeder = asyncio.create_task(later())
    frames = [f async for f in serving.stream(answer, first)]
    await feeder
    assert frames[0] == b'id: r1:0\ndata: {"a": 1}\n\n'
    assert b": keep-alive\n" in frames
    # the official client reads the events and nothing of the keep-alive: its
    # decoder keeps the last event id, and a comment ended by a blank line after an
    # id'd event reached it as an event with empty data, which it failed to parse
    events = list(SSEDecoder().iter_bytes(iter(frames)))
    assert [e.data for e in events] == ['{"a": 1}', '{"b": 2}', '{"c": 3}', "[DONE]"]
    # one reply may carry several chunk objects: each is its own event, numbered,
    # and the reply's events go out in one write
    assert frames[-1] == (b'id: r1:1\ndata: {"b": 2}\n\nid: r1:2\ndata: {"c": 3}\n\n'
                          b"data: [DONE]\n\n")
    # the last frame, which the response sends with the end of the body (gateway/sse.py)
    assert [isinstance(f, sse.Last) for f in frames] == [False] * (len(frames) - 1) + [True]


async def still_here() -> bool:
    return False


async def test_a_client_gone_before_the_first_reply_cancels_at_once() -> None:
    """Its task may wait behind busy workers for minutes: the cancel must not wait
    for the first token."""
    serving, answer, producer = setup(deadline_s=30)

    async def gone() -> bool:
        return True

    started = time.monotonic()
    assert await answer.first(gone) is None
    assert time.monotonic() - started < 5
    await asyncio.sleep(0.05)
    [(topic, value)] = producer.sent
    assert topic == "sv.control"
    assert default_codec().decode(value, "Control")["request_id"] == "r1"


async def test_closing_the_stream_early_cancels_the_generation() -> None:
    serving, answer, producer = setup()
    frames = serving.stream(answer, reply(0, "delta", [{"a": 1}]))
    assert await frames.__anext__() == b'id: r1:0\ndata: {"a": 1}\n\n'
    await frames.aclose()  # the client went away
    await asyncio.sleep(0.05)
    [(topic, value)] = producer.sent
    assert topic == "sv.control"
    control = default_codec().decode(value, "Control")
    assert control["request_id"] == "r1" and control["action"] == "cancel"


async def test_a_deadline_mid_stream_ends_it_with_an_error_event() -> None:
    serving, answer, producer = setup(keepalive=5.0, deadline_s=0.1)
    frames = [f async for f in serving.stream(answer, reply(0, "delta", [{"a": 1}]))]
    error = json.loads(frames[-2].split(b"data: ", 1)[1])
    assert error["error"]["code"] == "deadline_exceeded"
    assert frames[-1] == b"data: [DONE]\n\n" and isinstance(frames[-1], sse.Last)
    await asyncio.sleep(0.05)
    assert len(producer.sent) == 1  # and the generation is cancelled


def test_the_access_line_has_a_prompt_hash_never_the_prompt(caplog: Any) -> None:
    from gateway.submission import _prompt_hash
    from tests.support.factories import generation

    secret = generation([{"role": "user", "content": "my password is hunter2", "name": None}])
    digest = _prompt_hash(secret)
    assert len(digest) == 16 and digest == _prompt_hash(secret)
    serving, _, _ = setup()
    answer = Answer(ReplyStream("r9"), time.monotonic() + 5,
                    Router(), serving.submitter.cancels,  # type: ignore[arg-type]
                    access={"model": "smollm2", "kind": "chat", "prompt_sha256": digest})
    final = reply(0, "final")
    final["usage"] = {"prompt_tokens": 7, "completion_tokens": 3}
    answer.stream.put(final)
    with caplog.at_level("INFO", logger="conveyor.access"):
        asyncio.run(answer.next())
        answer.close("done")
        answer.close("done again")  # logged once
    [line] = [r.getMessage() for r in caplog.records if r.name == "conveyor.access"]
    assert "request=r9" in line and "status=200" in line and f"prompt_sha256={digest}" in line
    assert "prompt_tokens=7 completion_tokens=3" in line
    assert "hunter2" not in line


async def test_a_client_that_left_is_logged_as_499(caplog: Any) -> None:
    serving, answer, _ = setup()
    with caplog.at_level("INFO", logger="conveyor.access"):
        answer.close("client disconnected")
    [line] = [r.getMessage() for r in caplog.records if r.name == "conveyor.access"]
    assert "status=499" in line


async def test_streams_not_resumable_carry_no_ids_and_a_drop_cancels_at_once() -> None:
    serving, answer, producer = setup(grace_s=30, resumable=False)
    frames = serving.stream(answer, reply(0, "delta", [{"a": 1}]))
    assert await frames.__anext__() == b'data: {"a": 1}\n\n'
    await frames.aclose()  # the client went away: no grace to wait out
    await asyncio.sleep(0.05)
    [(topic, value)] = producer.sent
    assert topic == "sv.control"
    assert default_codec().decode(value, "Control")["action"] == "cancel"
