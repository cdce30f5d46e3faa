"""The Submitter: what the broker does to a request (a prompt 503, a 413, a
cancel that must arrive), and redaction before anything is written."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from conveyor.settings import load_settings
from gateway.replies import ReplyStream
from gateway.submission import Submitter
from schemas.codec import default_codec
from tests.support.gateway_fakes import Router, ScriptedProducer, cancels, submitter


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
    s = load_settings(topic_prefix="sv", produce_timeout_s=0.2, **settings)
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
    settings = load_settings(topic_prefix="sv", retry_backoff_max_s=0.02)
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
