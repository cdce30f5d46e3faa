"""The gateway's publisher: how each policy turns Kafka's failures into
Conveyor's (publish), keeps sending what must arrive (deliver), drops what may
be lost with one line (publish_soon), and what close waits for. The producer
is a scripted stand-in raising aiokafka's own errors; the real broker's outage
is tests/faults/gateway/test_publisher_faults.py."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from aiokafka import errors as kafka_errors

from conveyor.errors import (
    InvalidRequest,
    PipelineUnavailable,
    RequestTooLarge,
    SchemaError,
    TransientBrokerError,
)
from conveyor.settings import load_settings
from gateway.publisher import NotTakenInTime, Publisher
from schemas.codec import default_codec
from schemas.records import Control, Request
from tests.support.factories import generation
from tests.support.gateway_fakes import HANG, ScriptedProducer
from topics.catalog import AUDIT, CONTROL, KEYS, REQUESTS
from topics.envelope import new_envelope, now_ms

LOGGER = "gateway.publisher"


def make(*script: Any, **settings: Any) -> tuple[Publisher, ScriptedProducer]:
    producer = ScriptedProducer(list(script))
    values: dict[str, Any] = {"topic_prefix": "pb", "produce_timeout_s": 0.2,
                              "retry_backoff_max_s": 0.02, **settings}
    return Publisher(load_settings(**values), producer, default_codec()), producer  # type: ignore[arg-type]


def request(rid: str = "r1") -> Request:
    return Request(envelope=new_envelope(rid, reply_gateway="g", reply_partition=0),
                   generation=generation())


def cancel(rid: str = "r1") -> Control:
    return Control(request_id=rid, action="cancel", reason="client left", ts_ms=now_ms())


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


# -- publish: on a request's path ------------------------------------------------------

async def test_publish_sends_the_topic_s_event_with_its_key_and_headers() -> None:
    pub, producer = make()
    await pub.publish(REQUESTS, request(), "r1", headers=[("traceparent", b"00-x")])
    [(topic, value, key, headers)] = producer.sent
    assert (topic, key, headers) == ("pb.requests", b"r1", [("traceparent", b"00-x")])
    assert default_codec().decode(value, "Request")["envelope"]["request_id"] == "r1"


async def test_a_record_the_schema_cannot_hold_is_400_and_never_sent() -> None:
    pub, producer = make()
    with pytest.raises(InvalidRequest) as info:
        await pub.publish(REQUESTS, {"envelope": None}, "r1", what="the request")
    assert info.value.status == 400
    assert info.value.message.startswith("The request holds a value the pipeline cannot carry")
    assert producer.attempts == 0


async def test_an_event_over_max_event_bytes_is_413_before_a_round_trip() -> None:
    pub, producer = make(max_event_bytes=1000)
    big = Request(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                  generation=generation([{"role": "user", "content": "x" * 2000, "name": None}]))
    with pytest.raises(RequestTooLarge) as info:
        await pub.publish(REQUESTS, big, "r1")
    assert info.value.status == 413 and info.value.code == "request_too_large"
    assert producer.attempts == 0


async def test_an_event_the_broker_refuses_as_too_large_is_413() -> None:
    pub, _ = make(kafka_errors.MessageSizeTooLargeError("too big"))
    with pytest.raises(RequestTooLarge) as info:
        await pub.publish(REQUESTS, request(), "r1", what="the request")
    assert info.value.status == 413
    assert info.value.message.startswith("The request is larger than the pipeline can carry")


@pytest.mark.parametrize("error", [
    kafka_errors.KafkaConnectionError("refused"),
    kafka_errors.KafkaTimeoutError(),
    kafka_errors.NotLeaderForPartitionError(),
    kafka_errors.OutOfOrderSequenceNumber(),
    kafka_errors.TopicAuthorizationFailedError(),  # refused for good: still the pipeline's
    TransientBrokerError("a fresh producer could not start yet"),
    ConnectionRefusedError(111, "refused"),
])
async def test_a_broker_that_fails_is_503_pipeline_unavailable(error: BaseException) -> None:
    pub, _ = make(error)
    with pytest.raises(PipelineUnavailable) as info:
        await pub.publish(REQUESTS, request(), "r1")
    assert info.value.status == 503 and info.value.code == "pipeline_unavailable"
    assert not isinstance(info.value, NotTakenInTime)  # the send ended: nothing in flight


async def test_a_broker_that_does_not_answer_is_503_within_produce_timeout_s() -> None:
    pub, _ = make(HANG)
    started = time.monotonic()
    with pytest.raises(NotTakenInTime) as info:
        await pub.publish(REQUESTS, request(), "r1", what="the request")
    assert time.monotonic() - started < 1
    assert info.value.status == 503 and "did not take the request in time" in info.value.message


async def test_a_fault_of_conveyor_s_surfaces_as_itself_not_as_a_503() -> None:
    pub, _ = make(RuntimeError("a bug"))
    with pytest.raises(RuntimeError):
        await pub.publish(REQUESTS, request(), "r1")


async def test_a_topic_of_two_event_types_needs_the_type_named() -> None:
    pub, _ = make()
    with pytest.raises(ValueError, match="name the event type"):
        await pub.publish(KEYS, {}, "k1")


# -- deliver: what must arrive ---------------------------------------------------------

async def test_a_cancel_kafka_refuses_for_now_is_sent_again_until_taken(
        caplog: pytest.LogCaptureFixture) -> None:
    pub, producer = make(kafka_errors.KafkaConnectionError("refused"),
                         kafka_errors.NotLeaderForPartitionError(),
                         kafka_errors.KafkaTimeoutError())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert await pub.deliver(CONTROL, cancel(), "r1", what="the cancel of r1") is True
    assert producer.attempts == 4 and len(producer.sent) == 1
    [(topic, value, key, _)] = producer.sent
    assert topic == "pb.control" and key == b"r1"
    assert default_codec().decode(value, "Control")["request_id"] == "r1"
    [warning] = lines(caplog, logging.WARNING)  # three failures, one line
    assert "the cancel of r1 to pb.control not delivered yet, retrying" in warning
    assert lines(caplog, logging.INFO) == ["the cancel of r1 to pb.control delivered after "
                                           "a wait"]


async def test_a_send_kafka_holds_is_waited_for_never_sent_twice(
        caplog: pytest.LogCaptureFixture) -> None:
    pub, producer = make(HANG, produce_timeout_s=0.05)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        delivered = await pub.deliver(CONTROL, cancel(), "r1", until_ms=now_ms() + 300)
    assert delivered is False and producer.attempts == 1
    warnings = lines(caplog, logging.WARNING)
    assert len(warnings) == 2, warnings  # "still waiting" once, then "given up"
    assert "not taken by Kafka yet" in warnings[0] and "given up" in warnings[1]


async def test_past_its_deadline_a_cancel_is_given_up_with_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    pub, producer = make(*[kafka_errors.KafkaConnectionError("refused")] * 1000)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        delivered = await pub.deliver(CONTROL, cancel(), "r1", until_ms=now_ms() + 200)
    assert delivered is False and time.monotonic() - started < 1
    assert 2 <= producer.attempts < 100  # with backoff, not spinning
    assert sum("given up" in line for line in lines(caplog, logging.WARNING)) == 1


async def test_a_cancel_refused_for_good_is_not_sent_again(
        caplog: pytest.LogCaptureFixture) -> None:
    pub, producer = make(kafka_errors.TopicAuthorizationFailedError())
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert await pub.deliver(CONTROL, cancel(), "r1") is False
    assert producer.attempts == 1
    [error] = lines(caplog, logging.ERROR)
    assert "refused by Kafka for good" in error


async def test_a_cancel_that_cannot_be_encoded_fails_its_caller_at_once() -> None:
    pub, producer = make()
    with pytest.raises(SchemaError):
        pub.deliver(CONTROL, {"request_id": 1}, "r1")
    assert producer.attempts == 0


async def test_by_default_a_cancel_is_tried_for_request_timeout_s() -> None:
    pub, producer = make(*[kafka_errors.KafkaConnectionError("refused")] * 1000,
                         request_timeout_s=0.2)
    assert await pub.deliver(CONTROL, cancel(), "r1") is False
    assert producer.sent == []


# -- publish_soon: what may be lost ----------------------------------------------------

async def test_audit_events_kafka_does_not_take_are_dropped_with_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    pub, producer = make(*[kafka_errors.KafkaConnectionError("refused")] * 5)
    event: dict[str, Any] = {"ts_ms": 1, "action": "auth.failed", "tenant": "t",
                             "key_id": "", "hash_prefix": "", "actor": "g", "reason": "",
                             "request_id": "", "detail": {}}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tasks = [pub.publish_soon(AUDIT, event, "t", what="the audit event auth.failed")
                 for _ in range(5)]
        assert await asyncio.gather(*tasks) == [False] * 5
    assert producer.attempts == 5  # once each: never sent again
    [warning] = lines(caplog, logging.WARNING)
    assert warning.startswith("the audit event auth.failed not written to pb.audit")
    assert await pub.publish_soon(AUDIT, event, "t") is True
    assert len(producer.sent) == 1


async def test_an_event_that_cannot_be_encoded_is_dropped_not_raised(
        caplog: pytest.LogCaptureFixture) -> None:
    pub, producer = make()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await pub.publish_soon(AUDIT, {"action": 1}, "t") is False
    assert producer.attempts == 0 and len(lines(caplog, logging.WARNING)) == 1


# -- close ---------------------------------------------------------------------------

async def test_close_waits_for_what_is_on_its_way_then_stops_the_producer() -> None:
    pub, producer = make(kafka_errors.KafkaConnectionError("refused"))
    pub.deliver(CONTROL, cancel(), "r1")
    await pub.close(within_s=5)
    assert len(producer.sent) == 1 and producer.stopped


async def test_close_gives_up_what_kafka_does_not_take_in_time_in_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    pub, producer = make(HANG, HANG, produce_timeout_s=10)
    cancels = [pub.deliver(CONTROL, cancel(rid), rid) for rid in ("r1", "r2")]
    await asyncio.sleep(0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        await pub.close(within_s=0.1)
    assert time.monotonic() - started < 1 and producer.stopped
    assert all(task.cancelled() for task in cancels)
    assert lines(caplog, logging.WARNING) == [
        "2 background sends to Kafka not delivered when the gateway stopped (waited 0.1 s)"]


async def test_start_starts_the_producer() -> None:
    pub, producer = make()
    await pub.start()
    assert producer.started
