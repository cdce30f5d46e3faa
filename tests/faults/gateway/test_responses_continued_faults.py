"""Responses that continue (``previous_response_id``) under faults, with the
official client: the gateway that answered SIGKILLed and Redis flushed, another
replica continues the conversation whole from the log and lists its input
items; Kafka stopped is a prompt 503 in OpenAI's envelope, and once it is back
the chain continues with every turn."""

from __future__ import annotations

import time
from collections.abc import Callable

import openai
import pytest

from tests.pipeline.test_responses_continued import asked
from tests.support.pipeline import Pipeline
from tests.support.services import OwnKafka, OwnRedis


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_conversation_continues_through_a_killed_gateway_a_flush_and_a_kafka_stop(
        pipeline_factory: Callable[..., Pipeline], own_kafka: OwnKafka,
        own_redis: OwnRedis) -> None:
    p = pipeline_factory(workers=1, CONVEYOR_KAFKA_BOOTSTRAP=own_kafka.bootstrap,
                         CONVEYOR_REDIS_URL=own_redis.url)
    other = client(p.start_gateway("gateway-b"))
    first = client(p.base_url).responses.create(
        model="smollm2", input="My name is Ada. Count to 3.", max_output_tokens=4)
    p.kill("gateway")  # SIGKILL: the conversation is in the log, not in it
    own_redis.flush()
    second = other.responses.create(model="smollm2", input="Now count from 7.",
                                    previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id and second.output_text
    assert asked(p, second.id) == [
        ("user", "My name is Ada. Count to 3."), ("assistant", first.output_text),
        ("user", "Now count from 7.")]
    items = other.responses.input_items.list(second.id)
    assert [(i.type, i.content[0].text) for i in items.data] == [  # type: ignore[union-attr]
        ("message", "Now count from 7.")]

    own_kafka.stop()
    try:
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            other.responses.create(model="smollm2", input="And from 20.",
                                   previous_response_id=second.id, max_output_tokens=4)
        took = time.monotonic() - started
        assert refused.value.status_code == 503 and took < 30, f"{took:.1f} s"
        assert isinstance(refused.value.body, dict) and refused.value.body.get("type"), \
            refused.value.body
    finally:
        own_kafka.start()
    deadline = time.monotonic() + 120
    while True:
        try:
            third = other.responses.create(model="smollm2", input="And from 20.",
                                           previous_response_id=second.id,
                                           max_output_tokens=4)
            break
        except (openai.InternalServerError, openai.APIConnectionError):
            assert time.monotonic() < deadline, "no continuation after the broker came back"
            time.sleep(2)
    assert asked(p, third.id) == [
        ("user", "My name is Ada. Count to 3."), ("assistant", first.output_text),
        ("user", "Now count from 7."), ("assistant", second.output_text),
        ("user", "And from 20.")]
