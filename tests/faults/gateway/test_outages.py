"""The newer APIs through an outage of each part, with the clients that judge
them (``anthropic`` for Messages, ``openai`` for Responses that continue), on
one Conveyor of its own Kafka and Redis: the gateway that answered SIGKILLed
and Redis flushed, an ``x-api-key`` still holds (the keys are in the log) and
another replica continues a conversation whole from the log; Kafka stopped is
a prompt 529 ``overloaded_error`` on /v1/messages and a prompt 503 in OpenAI's
envelope on /v1/responses; once it is back, both answer again and the chain
continues with every turn."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

from tests.pipeline.test_responses_continued import asked
from tests.support.pipeline import ROOT, Pipeline
from tests.support.services import OwnKafka, OwnRedis

COUNT: Any = [{"role": "user", "content": "Count on: 1 2 3"}]
SECRET = f"conveyor-test-outages-{uuid.uuid4().hex}"
KEYS = {"CONVEYOR_AUTH": "keys", "CONVEYOR_AUTH_SECRET": SECRET}


def key(p: Pipeline) -> str:
    out = subprocess.run([sys.executable, "-m", "cli", "keys", "create", "--tenant",
                          f"t{uuid.uuid4().hex[:8]}", "--name", "outages"],
                         env={**p.env, **KEYS}, cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    found = re.search(r"cvy-\S+", out.strip().splitlines()[-1])
    assert found is not None, out
    return found.group(0)


def counted(message: anthropic.types.Message) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", message.content[0].text)]  # type: ignore[union-attr]


def back(ask: Callable[[], Any]) -> Any:
    """``ask()``'s answer once the pipeline answers again after an outage."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return ask()
        except (anthropic.APIStatusError, anthropic.APIConnectionError,
                openai.InternalServerError, openai.APIConnectionError):
            assert time.monotonic() < deadline, "no answer after the broker came back"
            time.sleep(2)


def test_messages_and_a_conversation_through_a_kill_a_flush_and_a_kafka_stop(
        pipeline_factory: Callable[..., Pipeline], own_kafka: OwnKafka,
        own_redis: OwnRedis) -> None:
    p = pipeline_factory(workers=1, CONVEYOR_KAFKA_BOOTSTRAP=own_kafka.bootstrap,
                         CONVEYOR_REDIS_URL=own_redis.url)
    claude = anthropic.Anthropic(base_url=p.start_gateway("gateway-keys", **KEYS),
                                 api_key=key(p), max_retries=0, timeout=120)  # as x-api-key
    other = openai.OpenAI(base_url=f"{p.start_gateway('gateway-b')}/v1", api_key="unused",
                          max_retries=0, timeout=120)
    first = openai.OpenAI(base_url=f"{p.base_url}/v1", api_key="unused", max_retries=0,
                          timeout=120).responses.create(
        model="smollm2", input="My name is Ada. Count to 3.", max_output_tokens=4)

    p.kill("gateway")  # SIGKILL: the conversation is in the log, not in it
    own_redis.flush()  # and the key is read back from conveyor.keys
    m = claude.messages.create(model="smollm2", max_tokens=3, messages=COUNT)
    assert m.stop_reason == "max_tokens" and counted(m) == [4, 5, 6]
    second = other.responses.create(model="smollm2", input="Now count from 7.",
                                    previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id and second.output_text
    assert asked(p, second.id) == [
        ("user", "My name is Ada. Count to 3."), ("assistant", first.output_text),
        ("user", "Now count from 7.")]
    [own] = other.responses.input_items.list(second.id).data
    assert own.content[0].text == "Now count from 7."  # type: ignore[union-attr]

    own_kafka.stop()
    try:
        started = time.monotonic()
        with pytest.raises(anthropic.OverloadedError) as overloaded:
            claude.messages.create(model="smollm2", max_tokens=3, messages=COUNT)
        with pytest.raises(openai.InternalServerError) as unavailable:
            other.responses.create(model="smollm2", input="And from 20.",
                                   previous_response_id=second.id, max_output_tokens=4)
        took = time.monotonic() - started
        assert took < 40, f"{took:.1f} s for both"
        assert overloaded.value.status_code == 529
        assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert unavailable.value.status_code == 503
        assert unavailable.value.body["code"] == "pipeline_unavailable"  # type: ignore[index]
    finally:
        own_kafka.start()
    assert counted(back(lambda: claude.messages.create(model="smollm2", max_tokens=3,
                                                       messages=COUNT))) == [4, 5, 6]
    third = back(lambda: other.responses.create(model="smollm2", input="And from 20.",
                                                previous_response_id=second.id,
                                                max_output_tokens=4))
    assert asked(p, third.id) == [
        ("user", "My name is Ada. Count to 3."), ("assistant", first.output_text),
        ("user", "Now count from 7."), ("assistant", second.output_text),
        ("user", "And from 20.")]
