"""Anthropic's Messages API under faults, with the unmodified ``anthropic``
client: a streamed message whose worker is SIGKILLed mid-answer is finished by
the other worker, counted on once with one ``message_stop``; Kafka stopped is a
prompt ``overloaded_error`` (529) in Anthropic's shape, and messages flow again
once it is back; an ``x-api-key`` keeps working after Redis is flushed (the
keys are in the log)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import anthropic
import pytest

from tests.faults.test_delivery import assert_continued_elsewhere, kill_its_worker
from tests.support.pipeline import ROOT, Pipeline
from tests.support.services import OwnKafka, OwnRedis

COUNT = [{"role": "user", "content": "Count on: 1 2 3"}]


def claude(url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture
def p(module_pipelines: Callable[..., Pipeline]) -> Iterator[Pipeline]:
    """Two scripted workers of one context each; what a test killed is started again."""
    shared = module_pipelines(workers=2, contexts=1)
    try:
        yield shared
    finally:
        shared.heal()


def test_a_worker_killed_mid_stream_leaves_one_message_counted_on(p: Pipeline) -> None:
    killed: list[str] = []
    text, stops, deltas, request_id = "", 0, 0, ""
    final: anthropic.types.MessageDeltaEvent | None = None
    stream = claude(p.base_url).messages.create(model="smollm2", max_tokens=150,
                                                messages=COUNT, stream=True)
    for event in stream:
        if event.type == "message_start":
            request_id = event.message.id.removeprefix("msg_")
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
            deltas += 1
            if deltas == 3:
                kill_its_worker(p, request_id, killed)
        elif event.type == "message_delta":
            final = event
        elif event.type == "message_stop":
            stops += 1
    assert killed and stops == 1 and final is not None
    assert final.delta.stop_reason == "max_tokens" and final.usage.output_tokens == 150
    numbers = [int(n) for n in re.findall(r"\d+", text)][:-1]  # the last may be cut
    assert numbers == list(range(4, 4 + len(numbers))) and len(numbers) > 50, text
    assert_continued_elsewhere(p, request_id, killed)


def test_kafka_stopped_is_a_prompt_overloaded_error_then_messages_flow_again(
        pipeline_factory: Callable[..., Pipeline], own_kafka: OwnKafka,
        own_redis: OwnRedis) -> None:
    secret = f"conveyor-test-messages-{uuid.uuid4().hex}"
    env = {"CONVEYOR_AUTH": "keys", "CONVEYOR_AUTH_SECRET": secret}
    pipe = pipeline_factory(workers=1, CONVEYOR_KAFKA_BOOTSTRAP=own_kafka.bootstrap,
                            CONVEYOR_REDIS_URL=own_redis.url)
    url = pipe.start_gateway("gateway-keys", **env)
    out = subprocess.run([sys.executable, "-m", "cli", "keys", "create", "--tenant",
                          f"t{uuid.uuid4().hex[:8]}", "--name", "messages"],
                         env={**pipe.env, **env}, cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    found = re.search(r"cvy-\S+", out.strip().splitlines()[-1])
    assert found is not None, out
    c = claude(url, found.group(0))  # sent as x-api-key
    assert c.messages.create(model="smollm2", max_tokens=3, messages=COUNT).content

    own_redis.flush()  # the key is read back from conveyor.keys
    m = c.messages.create(model="smollm2", max_tokens=3, messages=COUNT)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3

    own_kafka.stop()
    try:
        started = time.monotonic()
        with pytest.raises(anthropic.APIStatusError) as refused:
            c.messages.create(model="smollm2", max_tokens=3, messages=COUNT)
        took = time.monotonic() - started
        assert refused.value.status_code == 529 and took < 30, f"{took:.1f} s"
        assert isinstance(refused.value, anthropic.OverloadedError)
        body = refused.value.body
        assert isinstance(body, dict) and body["type"] == "error", body
        assert body["error"]["type"] == "overloaded_error", body
    finally:
        own_kafka.start()
    deadline = time.monotonic() + 120
    while True:
        try:
            again = c.messages.create(model="smollm2", max_tokens=3, messages=COUNT)
            break
        except (anthropic.APIStatusError, anthropic.APIConnectionError) as exc:
            assert getattr(exc, "status_code", 529) == 529, exc
            assert time.monotonic() < deadline, "no message after the broker came back"
            time.sleep(2)
    assert [int(n) for n in re.findall(r"\d+", again.content[0].text)] == [4, 5, 6]  # type: ignore[union-attr]
