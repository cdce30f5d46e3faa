"""ChatServing.stream: SSE framing, keep-alive comments, cancel on early close,
deadline; the Submitter: what the broker does to a request.

These run with ``resume_grace_s=0``: the cancel of a stream closed early is
then sent at once, as before streams could be resumed; the grace itself is
tested in tests/kafka/gateway/test_resume.py."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from conveyor.settings import Settings
from gateway import sse
from gateway.answer import Answer
from gateway.chat.serving import ChatServing
from gateway.replies import ReplyStream
from gateway.submission import Submitter
from schemas.codec import default_codec
from schemas.records import Reply
from tests.support.gateway_fakes import (
    RecordingProducer,
    Router,
    ScriptedProducer,
    cancels,
    chat_serving,
    submitter,
)
from topics.envelope import new_envelope


def reply(index: int, kind: str, chunks: list[dict[str, Any]] | None = None) -> Reply:
    return Reply(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                 index=index, kind=kind,  # type: ignore[typeddict-item]
                 text="", chunk="\n".join(json.dumps(c) for c in chunks or []),
                 finish_reason=None, usage=None, error=None)


def setup(keepalive: float = 0.05, deadline_s: float = 5.0, grace_s: float = 0,
          resumable: bool = True) -> tuple[ChatServing, Answer, RecordingProducer]:
    producer = RecordingProducer()
    settings = Settings(topic_prefix="sv", sse_keepalive_s=keepalive, resume_grace_s=grace_s,
                        resumable_streams=resumable)
    serving = chat_serving(settings, producer)
    answer = Answer(ReplyStream("r1"), time.monotonic() + deadline_s,
                    Router(), serving.cancels)  # type: ignore[arg-type]
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
    assert b": keep-alive\n\n" in frames
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
                    Router(), serving.cancels,  # type: ignore[arg-type]
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


# -- submission: what the broker does to a request ------------------------------

@dataclass
class SubmitRouter(Router):
    unreachable: bool = False
    partition: int = 0
    opened: list[str] = field(default_factory=list)

    def open(self, request_id: str) -> ReplyStream:
        self.opened.append(request_id)
        return ReplyStream(request_id)

    def kafka_unreachable(self) -> bool:
        return self.unreachable


@dataclass
class BrokerStandIn:
    """Stands in for AIOKafkaProducer: hangs like a producer whose broker is gone,
    or raises what aiokafka raises."""

    raises: BaseException | None = None
    sent: list[tuple[str, bytes]] = field(default_factory=list)

    async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None,
                            headers: Any = None) -> None:
        if topic.endswith(".control"):
            self.sent.append((topic, value))
            return
        if self.raises is not None:
            raise self.raises
        await asyncio.sleep(3600)


def submitting(producer: BrokerStandIn, unreachable: bool = False,
               **settings: Any) -> tuple[Submitter, SubmitRouter]:
    router = SubmitRouter(unreachable=unreachable)
    s = Settings(topic_prefix="sv", produce_timeout_s=0.2, **settings)
    return submitter(s, producer, router), router


async def test_a_broker_that_does_not_answer_is_a_prompt_503() -> None:
    from conveyor.errors import PipelineUnavailable
    from tests.support.factories import generation

    producer = BrokerStandIn()
    serving, router = submitting(producer)
    started = time.monotonic()
    with pytest.raises(PipelineUnavailable) as info:
        await serving.submit(generation())
    assert time.monotonic() - started < 5
    assert info.value.status == 503 and info.value.code == "pipeline_unavailable"
    assert router.closed == router.opened  # no stream left waiting
    await asyncio.sleep(0.05)
    [(topic, _)] = producer.sent  # and the request, should it still arrive, is cancelled
    assert topic == "sv.control"


async def test_a_cancel_kafka_refuses_for_now_still_arrives() -> None:
    # it was one attempt whose failure was swallowed: the generation ran on for a
    # client that had left (on the real broker: tests/faults/gateway/test_publisher_faults.py)
    from aiokafka.errors import KafkaConnectionError, NotLeaderForPartitionError

    producer = ScriptedProducer([KafkaConnectionError("refused"), NotLeaderForPartitionError()])
    settings = Settings(topic_prefix="sv", retry_backoff_max_s=0.02)
    cancels(settings, producer).cancel("r1", "client disconnected")
    for _ in range(200):
        if producer.sent:
            break
        await asyncio.sleep(0.01)
    [(topic, value, key, _)] = producer.sent
    assert (topic, key) == ("sv.control", b"r1") and producer.attempts == 3
    assert default_codec().decode(value, "Control")["request_id"] == "r1"


async def test_a_known_outage_is_refused_before_producing() -> None:
    from conveyor.errors import PipelineUnavailable
    from tests.support.factories import generation

    serving, router = submitting(BrokerStandIn(), unreachable=True)
    with pytest.raises(PipelineUnavailable):
        await serving.submit(generation())
    assert router.opened == []


async def test_an_event_the_broker_refuses_as_too_large_is_413() -> None:
    from aiokafka.errors import MessageSizeTooLargeError

    from conveyor.errors import RequestTooLarge
    from tests.support.factories import generation

    serving, _ = submitting(BrokerStandIn(raises=MessageSizeTooLargeError("too big")))
    with pytest.raises(RequestTooLarge) as info:
        await serving.submit(generation())
    assert info.value.status == 413 and info.value.code == "request_too_large"


async def test_an_event_over_max_event_bytes_is_413_before_producing() -> None:
    from conveyor.errors import RequestTooLarge
    from tests.support.factories import generation

    producer = BrokerStandIn()
    serving, _ = submitting(producer, max_event_bytes=1000)
    big = generation([{"role": "user", "content": "x" * 2000, "name": None}])
    with pytest.raises(RequestTooLarge):
        await serving.submit(big)


async def test_streams_not_resumable_carry_no_ids_and_a_drop_cancels_at_once() -> None:
    serving, answer, producer = setup(grace_s=30, resumable=False)
    frames = serving.stream(answer, reply(0, "delta", [{"a": 1}]))
    assert await frames.__anext__() == b'data: {"a": 1}\n\n'
    await frames.aclose()  # the client went away: no grace to wait out
    await asyncio.sleep(0.05)
    [(topic, value)] = producer.sent
    assert topic == "sv.control"
    assert default_codec().decode(value, "Control")["action"] == "cancel"


async def test_a_text_redacted_before_is_found_in_the_gateways_memo() -> None:
    """A conversation resends its earlier turns: the gateway searches each text once."""
    from schemas.codec import default_codec
    from tests.support.factories import generation

    sent: list[tuple[str, bytes]] = []

    class Accepting(BrokerStandIn):
        async def send_and_wait(self, topic: str, value: bytes, key: bytes | None = None,
                                headers: Any = None) -> None:
            sent.append((topic, value))

    serving, _ = submitting(Accepting())
    serving.policies.set("default", '[pii]\nredact = ["email", "phone"]\n')
    turn = generation(messages=[{"role": "user",
                                 "content": "Mail jane.doe@example.com or call +1 415 555 0134."}])
    for _ in range(2):
        await serving.submit(turn)
    requests = [default_codec().decode(v, "Request") for t, v in sent if t == "sv.requests"]
    assert [r["generation"]["messages"][0]["content"] for r in requests] == [
        "Mail <EMAIL_1> or call <PHONE_1>."] * 2
    assert (serving.find_memo.hits, serving.find_memo.misses) == (1, 1)
