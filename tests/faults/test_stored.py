"""Stored answers read back from the log with the official client, on the real
pipeline: ``client.chat.completions.retrieve`` and ``.messages.list`` for a
chat completion created with ``store=True``, ``client.responses.retrieve`` for
a direct response; refused (404) when not stored, through the other API, or
for another tenant; read from another gateway replica after the one that
answered was SIGKILLed; through a flushed or stopped Redis, and after a
Kafka outage."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.support.pipeline import ROOT, Pipeline
from tests.support.services import OwnKafka, OwnRedis

CHAT: dict[str, Any] = {
    "model": "smollm2", "temperature": 0, "seed": 7, "max_tokens": 12,
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "Name a planet."}]}


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def test_a_stored_chat_completion_reads_back_as_it_was_answered(pipeline: Pipeline) -> None:
    c = client(pipeline.base_url)
    created = c.chat.completions.create(store=True, metadata={"run": "nightly"}, **CHAT)
    again = c.chat.completions.retrieve(created.id)
    assert again.model_dump() == created.model_dump()
    assert again.choices[0].message.content
    assert again.usage is not None and again.usage.completion_tokens > 0


def test_a_streamed_stored_chat_completion_reads_back_whole(pipeline: Pipeline) -> None:
    c = client(pipeline.base_url)
    chunks = list(c.chat.completions.create(store=True, stream=True,
                                            stream_options={"include_usage": True}, **CHAT))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    again = c.chat.completions.retrieve(chunks[0].id)
    assert again.id == chunks[0].id and again.choices[0].message.content == text
    assert again.usage is not None and chunks[-1].usage is not None
    assert again.usage.completion_tokens == chunks[-1].usage.completion_tokens


def test_its_messages_list_as_they_were_asked(pipeline: Pipeline) -> None:
    c = client(pipeline.base_url)
    created = c.chat.completions.create(store=True, **CHAT)
    page = c.chat.completions.messages.list(created.id)
    assert [(m.role, m.content) for m in page.data] == [
        ("system", "Be brief."), ("user", "Name a planet.")]
    assert [m.id for m in page.data] == [f"{created.id}-0", f"{created.id}-1"]
    newest = c.chat.completions.messages.list(created.id, order="desc", limit=1)
    assert [m.content for m in newest.data] == ["Name a planet."] and newest.has_more
    rest = c.chat.completions.messages.list(created.id, order="desc", after=newest.data[0].id)
    assert [m.content for m in rest.data] == ["Be brief."] and not rest.has_more


def test_an_answer_not_stored_is_not_found(pipeline: Pipeline) -> None:
    c = client(pipeline.base_url)
    plain = c.chat.completions.create(**CHAT)  # store defaults to false
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.retrieve(plain.id)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.messages.list(plain.id)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.retrieve(f"chatcmpl-{uuid.uuid4().hex}")
    with pytest.raises(openai.BadRequestError):  # completions are never stored
        c.completions.create(model="smollm2", prompt="hi", max_tokens=2,
                             extra_body={"store": True})


def test_a_direct_response_reads_back_unless_store_is_false(pipeline: Pipeline) -> None:
    c = client(pipeline.base_url)
    ask: dict[str, Any] = {"model": "smollm2", "temperature": 0, "max_output_tokens": 12,
                           "instructions": "Be brief.", "input": "Name a planet.",
                           "metadata": {"run": "nightly"}}
    created = c.responses.create(**ask)
    assert created.store is True
    again = c.responses.retrieve(created.id)
    assert again.output_text == created.output_text and again.status == created.status
    assert again.usage == created.usage and again.metadata == {"run": "nightly"}
    assert again.instructions == "Be brief." and again.store is True
    # a response is not a chat completion, though both are in the same log
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.retrieve("chatcmpl-" + created.id.removeprefix("resp_"))
    unstored = c.responses.create(store=False, **ask)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


def test_another_replica_reads_it_after_a_sigkill_and_only_its_tenant(
        pipeline: Pipeline) -> None:
    secret = f"conveyor-test-stored-{uuid.uuid4().hex}"
    env = {"CONVEYOR_AUTH": "keys", "CONVEYOR_AUTH_SECRET": secret}

    def key(tenant: str) -> str:
        out = subprocess.run([sys.executable, "-m", "cli", "keys", "create", "--tenant",
                              tenant, "--name", "stored"], env={**pipeline.env, **env},
                             cwd=ROOT, capture_output=True, text=True, timeout=60,
                             check=True).stdout
        found = re.search(r"cvy-\S+", out.strip().splitlines()[-1])
        assert found is not None, out
        return found.group(0)

    a = pipeline.start_gateway("gateway-stored-a", **env)
    b = pipeline.start_gateway("gateway-stored-b", **env)
    try:
        owner, stranger = key(f"t{uuid.uuid4().hex[:8]}"), key(f"t{uuid.uuid4().hex[:8]}")
        created = client(a, owner).chat.completions.create(store=True, **CHAT)
        pipeline.kill("gateway-stored-a")  # SIGKILL: the answer is in the log, not in it
        assert client(b, owner).chat.completions.retrieve(created.id).model_dump() == \
            created.model_dump()
        with pytest.raises(openai.NotFoundError):
            client(b, stranger).chat.completions.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            client(b, stranger).chat.completions.messages.list(created.id)
    finally:
        for name in ("gateway-stored-a", "gateway-stored-b"):
            if pipeline.procs[name].poll() is None:
                pipeline.kill(name, signal.SIGTERM)


def test_a_stored_answer_outlives_redis_and_waits_out_kafka(
        pipeline_factory: Callable[..., Pipeline], own_kafka: OwnKafka,
        own_redis: OwnRedis) -> None:
    """Redis flushed or stopped changes nothing (the answer is in the log); Kafka
    stopped is a prompt 503 in OpenAI's envelope, then the answer once it is back."""
    p = pipeline_factory(workers=1, CONVEYOR_KAFKA_BOOTSTRAP=own_kafka.bootstrap,
                         CONVEYOR_REDIS_URL=own_redis.url)
    c = client(p.base_url)
    created = c.chat.completions.create(store=True, **CHAT).model_dump()
    own_redis.flush()
    assert c.chat.completions.retrieve(created["id"]).model_dump() == created
    own_redis.stop()
    try:
        assert c.chat.completions.retrieve(created["id"]).model_dump() == created
    finally:
        own_redis.start()
    own_kafka.stop()
    try:
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as refused:
            c.chat.completions.retrieve(created["id"])
        took = time.monotonic() - started
        assert refused.value.status_code == 503 and took < 30, f"{took:.1f} s"
    finally:
        own_kafka.start()
    deadline = time.monotonic() + 120
    while True:
        try:
            again = c.chat.completions.retrieve(created["id"]).model_dump()
            break
        except (openai.InternalServerError, openai.APIConnectionError):
            assert time.monotonic() < deadline, "not readable after the broker came back"
            time.sleep(2)
    assert again == created
