"""Anthropic's Messages API (``POST /v1/messages``) through the whole pipeline,
driven by the official ``anthropic`` client, unmodified: messages created and
streamed (raw events and the ``messages.stream`` helper), stop sequences,
usage, the errors in Anthropic's shape (a bad body, an unknown model, a wrong
``x-api-key``), and the request as ``conveyor inspect`` shows it. The scripted
engine counts on from the prompt's last number, so what it answers is known."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from tests.support.pipeline import Pipeline

SECRET = "messages-test-secret"


def claude(p: Pipeline | str, api_key: str = "unused") -> anthropic.Anthropic:
    """The unmodified ``anthropic`` client, pointed at a gateway."""
    url = p if isinstance(p, str) else p.base_url
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=120)


COUNT = [{"role": "user", "content": "Count on: 1 2 3"}]


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def test_a_message_counts_on(pipeline: Pipeline) -> None:
    m = claude(pipeline).messages.create(model="smollm2", max_tokens=5, messages=COUNT)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == "smollm2"
    [block] = m.content
    assert block.type == "text" and numbers(block.text) == [4, 5, 6, 7, 8]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 5 and m.usage.input_tokens > 0


def test_system_and_content_blocks_reach_the_prompt(pipeline: Pipeline) -> None:
    c = claude(pipeline)
    plain = c.messages.create(model="smollm2", max_tokens=2, system="Be brief.",
                              messages=COUNT)
    blocks = c.messages.create(
        model="smollm2", max_tokens=2, system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Count on: 1 2 3"}]}])
    assert plain.usage.input_tokens == blocks.usage.input_tokens
    assert [b.text for b in plain.content] == [b.text for b in blocks.content]  # type: ignore[union-attr]
    bare = c.messages.create(model="smollm2", max_tokens=2, messages=COUNT)
    assert bare.usage.input_tokens != plain.usage.input_tokens


def test_a_stop_sequence_ends_the_message(pipeline: Pipeline) -> None:
    m = claude(pipeline).messages.create(model="smollm2", max_tokens=20, messages=COUNT,
                                         stop_sequences=["7"])
    assert m.content[0].type == "text" and numbers(m.content[0].text) == [4, 5, 6]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "7"
    assert m.usage.output_tokens < 20


def test_raw_stream_events_come_in_anthropics_order(pipeline: Pipeline) -> None:
    with claude(pipeline).messages.create(model="smollm2", max_tokens=4, messages=COUNT,
                                          stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]  # the client leaves out the pings
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0]
    assert start.type == "message_start" and start.message.id.startswith("msg_")
    assert start.message.content == [] and start.message.stop_reason is None
    text = "".join(e.delta.text for e in events
                   if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert numbers(text) == [4, 5, 6, 7]
    delta = events[-2]
    assert delta.type == "message_delta" and delta.delta.stop_reason == "max_tokens"
    assert delta.usage.output_tokens == 4 and (delta.usage.input_tokens or 0) > 0


def test_a_ping_follows_the_first_block_start_on_the_wire(pipeline: Pipeline) -> None:
    ask = {"model": "smollm2", "max_tokens": 3, "messages": COUNT, "stream": True}
    with httpx.stream("POST", f"{pipeline.base_url}/v1/messages", json=ask, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        names = [line.removeprefix("event: ") for line in r.iter_lines()
                 if line.startswith("event: ")]
    assert names[:4] == ["message_start", "content_block_start", "ping",
                         "content_block_delta"]
    assert names[-1] == "message_stop"


def test_a_failure_mid_stream_is_an_error_event(pipeline: Pipeline) -> None:
    """The request's deadline passes once the stream began: the status is sent,
    so the failure is Anthropic's ``error`` event, which the client raises."""
    ask = {"model": "smollm2", "max_tokens": 400, "messages": COUNT, "stream": True}
    with httpx.stream("POST", f"{pipeline.base_url}/v1/messages", json=ask, timeout=60,
                      headers={"x-conveyor-timeout": "1.5"}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    assert "event: error" in lines and "event: message_stop" not in lines
    error = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "timeout_error"
    with pytest.raises(anthropic.APIStatusError) as raised:
        with claude(pipeline).messages.stream(
                model="smollm2", max_tokens=400, messages=COUNT,
                extra_headers={"x-conveyor-timeout": "1.5"}) as stream:
            for _ in stream:
                pass
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["error"]["type"] == "timeout_error"


def test_the_stream_helper_builds_the_message(pipeline: Pipeline) -> None:
    c = claude(pipeline)
    with c.messages.stream(model="smollm2", max_tokens=6, messages=COUNT) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert numbers("".join(pieces)) == [4, 5, 6, 7, 8, 9]
    assert final.content[0].type == "text" and final.content[0].text == "".join(pieces)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    whole = c.messages.create(model="smollm2", max_tokens=6, messages=COUNT)
    assert whole.usage.input_tokens == final.usage.input_tokens
    assert [b.text for b in whole.content] == [b.text for b in final.content]  # type: ignore[union-attr]


def test_a_bad_body_is_anthropics_invalid_request_error(pipeline: Pipeline) -> None:
    c = claude(pipeline)
    with pytest.raises(anthropic.BadRequestError) as missing:
        c.post("/v1/messages", cast_to=object, body={"model": "smollm2", "messages": COUNT})
    body = missing.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as role:
        c.messages.create(model="smollm2", max_tokens=4,
                          messages=[{"role": "system", "content": "hi"}])  # type: ignore[typeddict-item]
    assert "messages.0.role" in str(role.value)
    with pytest.raises(anthropic.BadRequestError) as image:
        c.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    assert "messages.0.content.1" in str(image.value) and "image" in str(image.value)
    with pytest.raises(anthropic.BadRequestError) as top_k:
        c.messages.create(model="smollm2", max_tokens=4, messages=COUNT,
                          extra_body={"top_k": 5})
    assert "top_k" in str(top_k.value)


def test_an_unknown_model_is_not_found_error(pipeline: Pipeline) -> None:
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude(pipeline).messages.create(model="claude-nonesuch", max_tokens=4, messages=COUNT)
    body = unknown.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "not_found_error"
    assert "claude-nonesuch" in body["error"]["message"]


def test_a_streamed_request_refused_before_it_starts_gets_its_status(
        pipeline: Pipeline) -> None:
    with pytest.raises(anthropic.NotFoundError):
        claude(pipeline).messages.create(model="claude-nonesuch", max_tokens=4,
                                         messages=COUNT, stream=True)


def test_anthropic_version_is_accepted_and_may_be_absent(pipeline: Pipeline) -> None:
    ask = {"model": "smollm2", "max_tokens": 2, "messages": COUNT}
    for headers in ({}, {"anthropic-version": "2023-06-01"}):
        r = httpx.post(f"{pipeline.base_url}/v1/messages", json=ask, headers=headers,
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["type"] == "message" and r.headers["request-id"]


def test_a_message_shows_in_conveyor_inspect(pipeline: Pipeline) -> None:
    m = claude(pipeline).messages.create(model="smollm2", max_tokens=3, messages=[
        {"role": "user", "content": "Count on from 40: 41"}])
    rid = m.id.removeprefix("msg_")
    report = json.loads(pipeline.cli("inspect", rid, "--json"))
    assert report["layers"]["gateway"] and report["layers"]["postprocess"]
    assert report["usage"]["completion_tokens"] == m.usage.output_tokens == 3
    assert report["usage"]["prompt_tokens"] == m.usage.input_tokens + (
        m.usage.cache_read_input_tokens or 0)


# -- keys: x-api-key as well as a bearer token ------------------------------------

@pytest.fixture(scope="module")
def keyed(services: None, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Pipeline, str]]:
    """A gateway with ``CONVEYOR_AUTH=keys`` (no workers: its tests end at the edge)."""
    p = Pipeline(tmp_path_factory.mktemp("messages-keys"), CONVEYOR_AUTH="keys",
                 CONVEYOR_AUTH_SECRET=SECRET)
    try:
        p.cli("topics")
        yield p, p.start_gateway("gateway")
    finally:
        p.close()


def test_x_api_key_authenticates(keyed: tuple[Pipeline, str]) -> None:
    p, url = keyed
    out = p.cli("keys", "create", "--tenant", f"t{uuid.uuid4().hex[:8]}", "--name", "msgs")
    secret = out.strip().splitlines()[-1]
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        claude(url, api_key="sk-wrong").messages.create(model="smollm2", max_tokens=4,
                                                        messages=COUNT)
    body = wrong.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"
    # the right key passes the edge (which reads no body before it): what stops
    # the request is its body, which lacks max_tokens
    for c in (claude(url, api_key=secret),  # x-api-key
              anthropic.Anthropic(base_url=url, auth_token=secret, max_retries=0)):  # bearer
        with pytest.raises(anthropic.BadRequestError) as bad:
            c.post("/v1/messages", cast_to=object, body={"model": "smollm2",
                                                         "messages": COUNT})
        assert "max_tokens" in str(bad.value)
    r = httpx.post(f"{url}/v1/messages", json={"model": "smollm2", "messages": COUNT})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_a_keys_limits_apply_in_anthropics_shapes(keyed: tuple[Pipeline, str]) -> None:
    """A key of one request a minute: its first request is admitted (and, with no
    worker behind this gateway, runs out its deadline: timeout_error), the next is
    over the limit (rate_limit_error, with Retry-After)."""
    p, url = keyed
    out = p.cli("keys", "create", "--tenant", f"t{uuid.uuid4().hex[:8]}", "--name", "one",
                "--rpm", "1")
    c = claude(url, api_key=out.strip().splitlines()[-1])
    with pytest.raises(anthropic.APIStatusError) as late:
        c.messages.create(model="smollm2", max_tokens=4, messages=COUNT,
                          extra_headers={"x-conveyor-timeout": "1"})
    assert late.value.status_code == 504
    assert late.value.body["error"]["type"] == "timeout_error"  # type: ignore[index]
    with pytest.raises(anthropic.RateLimitError) as limited:
        c.messages.create(model="smollm2", max_tokens=4, messages=COUNT)
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(limited.value.response.headers["retry-after"]) > 0
