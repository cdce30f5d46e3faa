"""The chunk objects postprocess assembles are valid OpenAI objects: each is parsed
with the official ``openai`` package's own types."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from schemas.openai.chunks import completion_id, delta_chunk, usage_chunk
from schemas.records import ChunkHeader, Usage


def header(kind: Literal["chat", "completion"] = "chat", include_usage: bool = False
           ) -> ChunkHeader:
    return ChunkHeader(kind=kind, model="smollm2-135m-instruct", created=1_700_000_000,
                       stop=[], stream=True, include_usage=include_usage, prompt_tokens=7)


def test_completion_ids_follow_openai_prefixes() -> None:
    assert completion_id(header("chat"), "r1") == "chatcmpl-r1"
    assert completion_id(header("completion"), "r1") == "cmpl-r1"


def test_role_chunk() -> None:
    raw = delta_chunk(header(), "r1", "", role=True)
    c = ChatCompletionChunk.model_validate_json(raw)
    assert c.object == "chat.completion.chunk"
    assert c.id == "chatcmpl-r1" and c.model == "smollm2-135m-instruct"
    assert c.created == 1_700_000_000
    assert len(c.choices) == 1
    choice = c.choices[0]
    assert choice.index == 0 and choice.finish_reason is None
    assert choice.delta.role == "assistant" and choice.delta.content == ""
    assert "usage" not in json.loads(raw)


def test_content_chunk() -> None:
    raw = delta_chunk(header(), "r1", "Héllo \u2603")
    c = ChatCompletionChunk.model_validate_json(raw)
    assert c.choices[0].delta.content == "Héllo \u2603"
    assert c.choices[0].delta.role is None
    assert c.choices[0].finish_reason is None
    assert "\u2603" in raw  # UTF-8 text, not \u escapes


def test_text_orjson_refuses_is_written_all_the_same() -> None:
    raw = delta_chunk(header(), "r1", "half a pair \ud83d")  # a lone surrogate
    assert json.loads(raw)["choices"][0]["delta"]["content"] == "half a pair \ud83d"
    assert raw == json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":"))


def test_finish_chunk_has_an_empty_delta() -> None:
    raw = delta_chunk(header(), "r1", "", "stop")
    c = ChatCompletionChunk.model_validate_json(raw)
    assert c.choices[0].finish_reason == "stop"
    assert json.loads(raw)["choices"][0]["delta"] == {}


def test_finish_chunk_may_carry_the_last_text() -> None:
    c = ChatCompletionChunk.model_validate_json(delta_chunk(header(), "r1", "end", "length"))
    assert c.choices[0].delta.content == "end"
    assert c.choices[0].finish_reason == "length"


def test_chat_usage_chunk() -> None:
    usage = Usage(prompt_tokens=7, completion_tokens=3)
    raw = usage_chunk(header(include_usage=True), "r1", usage)
    c = ChatCompletionChunk.model_validate_json(raw)
    assert c.choices == []
    assert c.usage is not None
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (7, 3, 10)


@pytest.mark.parametrize("role", [True, False])
@pytest.mark.parametrize("finish", [None, "stop"])
def test_include_usage_puts_a_null_usage_on_every_other_chunk(role: bool,
                                                              finish: str | None) -> None:
    raw = delta_chunk(header(include_usage=True), "r1", "x", finish, role=role)
    body = json.loads(raw)
    assert "usage" in body and body["usage"] is None
    assert ChatCompletionChunk.model_validate_json(raw).usage is None


def test_completion_content_chunk() -> None:
    raw = delta_chunk(header("completion"), "r1", "Once")
    body = json.loads(raw)
    assert body["object"] == "text_completion" and body["id"] == "cmpl-r1"
    assert body["choices"] == [{"index": 0, "text": "Once", "logprobs": None,
                                "finish_reason": None}]
    # The SDK's CompletionChoice types finish_reason as required, although the API
    # streams null until the last chunk; check the rest of the shape with the SDK.
    body["choices"][0]["finish_reason"] = "stop"
    c = Completion.model_validate(body)
    assert c.choices[0].text == "Once"


def test_completion_finish_chunk() -> None:
    raw = delta_chunk(header("completion"), "r1", "", "length")
    c = Completion.model_validate_json(raw)
    assert c.object == "text_completion" and c.id == "cmpl-r1"
    assert c.choices[0].text == "" and c.choices[0].finish_reason == "length"
    assert "usage" not in json.loads(raw)


def test_completion_usage_chunk() -> None:
    raw = usage_chunk(header("completion", include_usage=True), "r1",
                      Usage(prompt_tokens=2, completion_tokens=16))
    c = Completion.model_validate_json(raw)
    assert c.choices == []
    assert c.usage is not None and c.usage.total_tokens == 18


def test_completion_include_usage_puts_null_usage_on_deltas() -> None:
    raw = delta_chunk(header("completion", include_usage=True), "r1", "", "stop")
    assert json.loads(raw)["usage"] is None
    assert Completion.model_validate_json(raw).usage is None
