"""The exact prompt cache's pure part: which answers may be cached, the key
that names one, an entry's stored form and the chunk a hit becomes. The
Redis-backed PromptCache is tested in tests/kafka/workers/test_prompt_cache_redis.py."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from schemas.codec import default_codec
from schemas.records import Generation, Message, Prompt, ResponseFormat, Tools
from tests.support.factories import generation
from topics.envelope import new_envelope
from workers.prompt_cache import CACHE_WORKER, Cached, cache_key, cacheable, hit_chunk

FINGERPRINT = "f" * 32


def message(content: str) -> Message:
    return {"role": "user", "content": content, "name": None, "tool_calls": None,
            "tool_call_id": None}


def greedy(**sampling: Any) -> Generation:
    g = generation([message("What is Kafka?")], temperature=0.0, created=1_700_000_000)
    g["sampling"].update(sampling)  # type: ignore[typeddict-item]
    return g


def key(g: Generation | None = None, *, tenant: str = "acme", model: str = "smollm2",
        fingerprint: str = FINGERPRINT, max_tokens: int = 64) -> str | None:
    return cache_key(tenant, model, fingerprint, g if g is not None else greedy(), max_tokens)


def tools(name: str = "get_weather") -> Tools:
    return Tools(functions=[{"name": name, "description": "The weather of a city.",
                             "parameters": '{"type":"object"}', "strict": False}],
                 choice="auto", function="", parallel=True)


# --- cacheable -----------------------------------------------------------------------------


def test_a_greedy_answer_is_cacheable() -> None:
    assert cacheable(greedy())
    assert cacheable(greedy(temperature=-0.0))


def test_a_sampled_answer_is_not_cacheable() -> None:
    assert not cacheable(greedy(temperature=0.7))
    assert not cacheable(greedy(temperature=0.7, seed=None))


def test_a_sampled_answer_with_a_seed_is_cacheable() -> None:
    assert cacheable(greedy(temperature=0.7, seed=42))
    assert cacheable(greedy(temperature=1.5, seed=0))  # seed 0 is a seed


def test_an_answer_with_logprobs_is_not_cacheable() -> None:
    assert not cacheable(greedy(logprobs=True))
    assert not cacheable(greedy(logprobs=True, top_logprobs=3))
    assert not cacheable(greedy(temperature=0.7, seed=42, logprobs=True))


def test_a_request_that_is_not_cacheable_has_no_key() -> None:
    assert key(greedy(temperature=0.7)) is None
    assert key(greedy(logprobs=True)) is None


# --- cache_key -----------------------------------------------------------------------------


def test_the_key_names_the_tenant_and_is_stable() -> None:
    first = key()
    assert first is not None
    tenant, digest = first.split(":")
    assert tenant == "acme" and len(digest) == 40 and int(digest, 16) >= 0
    assert key() == first  # equal inputs, equal keys
    assert key(greedy()) == first  # an equal request built again
    # what does not shape the text: the stream flags, metadata, the sampling's max_tokens
    same = greedy(max_tokens=999)
    same.update({"stream": True, "include_usage": True, "metadata": {"k": "v"},
                 "created": 5})
    assert key(same) == first


@pytest.mark.parametrize("change", [
    {"tenant": "globex"},
    {"model": "smollm2-next"},
    {"fingerprint": "e" * 32},
    {"max_tokens": 65},
])
def test_the_key_differs_by_tenant_model_fingerprint_and_budget(change: dict[str, Any]
                                                                ) -> None:
    assert key(**change) is not None and key(**change) != key()


def test_the_key_differs_by_the_stop_sequences() -> None:
    keys = {key(greedy(stop=s)) for s in ([], ["\n"], ["END"], ["END", "\n"])}
    assert len(keys) == 4


def test_the_key_differs_by_the_response_format() -> None:
    json_object = greedy()
    json_object["response_format"] = ResponseFormat(type="json_object", name="", schema="",
                                                    strict=False)
    schema = greedy()
    schema["response_format"] = ResponseFormat(type="json_schema", name="x",
                                               schema='{"type":"object"}', strict=True)
    keys = [key(), key(json_object), key(schema)]
    assert len(set(keys)) == 3


def test_the_key_differs_by_the_tools() -> None:
    weather, clock, none = greedy(), greedy(), greedy()
    weather["tools"], clock["tools"] = tools("get_weather"), tools("get_time")
    none["tools"] = {**tools("get_weather"), "choice": "none"}
    keys = [key(), key(weather), key(clock), key(none)]
    assert len(set(keys)) == 4


def test_the_key_differs_by_the_other_sampling_fields_and_the_kind() -> None:
    base = key()
    assert key(greedy(top_p=0.5)) != base
    assert key(greedy(seed=7)) != base
    assert key(greedy(presence_penalty=0.5)) != base
    completion = generation(kind="completion", prompt="What is Kafka?", temperature=0.0)
    assert key(completion) != base


# --- Cached --------------------------------------------------------------------------------


def test_an_entry_round_trips() -> None:
    entry = Cached(text="Kafka is a log. «ünïcode» \n\"quoted\"", tokens=12,
                   finish_reason="stop", model="smollm2-135m-instruct")
    value = entry.value()
    assert json.loads(value)["text"] == entry.text
    assert "ü" in value  # kept as written, not escaped
    assert Cached.parse(value) == entry
    assert Cached.parse(value.encode()) == entry  # as Redis hands it back


@pytest.mark.parametrize("raw", [
    b"", b"not json", b"\xff\xfe", b"[]", b"null", b'"text"',
    b'{"text": "a", "tokens": 1, "finish_reason": "stop"}',
    b'{"text": "a", "tokens": "many", "finish_reason": "stop", "model": "m"}',
    b'{"text": "a", "tokens": null, "finish_reason": "stop", "model": "m"}',
])
def test_garbage_parses_to_none(raw: bytes) -> None:
    assert Cached.parse(raw) is None


# --- hit_chunk -----------------------------------------------------------------------------


def prompt(tokens: int = 23) -> Prompt:
    return Prompt(text="<|im_start|>user\nWhat is Kafka?<|im_end|>\n", tokens=tokens,
                  exact=True, max_tokens=64, dropped_messages=0, fingerprint=FINGERPRINT,
                  prefix_blocks=[], cache_key="acme:" + "0" * 40, cache_ttl_s=600)


def test_a_hit_is_the_whole_answer_in_one_chunk() -> None:
    envelope = new_envelope("req-1", reply_gateway="g", reply_partition=2, tenant="acme")
    g = greedy(stop=["END"])
    g.update({"stream": True, "include_usage": True})
    cached = Cached(text="Kafka is a distributed log.", tokens=7, finish_reason="length",
                    model="smollm2-135m-instruct")

    chunk = hit_chunk(envelope, g, prompt(23), cached)

    assert chunk["envelope"] is envelope
    assert (chunk["seq"], chunk["run_start"]) == (0, 0)
    assert chunk["worker_id"] == CACHE_WORKER == "cache"
    assert (chunk["text"], chunk["tokens"]) == (cached.text, 7)
    assert chunk["finish_reason"] == "length"
    assert chunk["error"] is None and chunk["logprobs"] == []
    assert chunk["cached_tokens"] == 23
    header = chunk["header"]
    assert header is not None
    assert header["prompt_tokens"] == 23
    assert header["model"] == "smollm2-135m-instruct"  # the model that answered
    assert (header["kind"], header["created"], header["stop"]) == ("chat", 1_700_000_000,
                                                                  ["END"])
    assert header["stream"] is True and header["include_usage"] is True
    assert header.get("tool_calls") is False and header.get("logprobs") is False
    # a run id of its own, the same for one request whenever the hit is made
    assert chunk["run_id"] == "cache" + hashlib.sha256(b"req-1").hexdigest()[:7]
    assert hit_chunk(envelope, g, prompt(23), cached)["run_id"] == chunk["run_id"]
    other = new_envelope("req-2", reply_gateway="g", reply_partition=2)
    assert hit_chunk(other, g, prompt(23), cached)["run_id"] != chunk["run_id"]
    # and it is a TokenChunk the log takes
    codec = default_codec()
    assert codec.decode(codec.encode("TokenChunk", chunk), "TokenChunk") == chunk


def test_a_hit_of_a_request_with_tools_is_read_for_calls() -> None:
    g = greedy()
    g["tools"] = tools()
    envelope = new_envelope("req-3", reply_gateway="g", reply_partition=0)
    cached = Cached(text="{}", tokens=1, finish_reason="stop", model="m")
    header = hit_chunk(envelope, g, prompt(), cached)["header"]
    assert header is not None and header.get("tool_calls") is True
