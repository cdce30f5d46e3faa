"""The codec: single-object encoding, schema evolution, poison detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastavro import parse_schema

from conveyor.errors import SchemaError
from schemas.codec import EVENT_TYPES, MAGIC, Codec, default_codec
from schemas.records import Request
from topics.envelope import new_envelope

HISTORY = Path(__file__).resolve().parents[3] / "schemas" / "avro" / "history"


def request() -> Request:
    return Request(
        envelope=new_envelope("r1", reply_gateway="gw", reply_partition=2, deadline_ms=99,
                              priority=1),
        generation={
            "kind": "chat", "model": "smollm2",
            "messages": [{"role": "user", "content": "héllo", "name": None,
                          "tool_calls": None, "tool_call_id": None},
                         {"role": "assistant", "content": "", "name": None,
                          "tool_calls": [{"id": "call_1", "name": "f", "arguments": "{}"}],
                          "tool_call_id": None},
                         {"role": "tool", "content": "42", "name": None, "tool_calls": None,
                          "tool_call_id": "call_1"}],
            "prompt": None,
            "sampling": {"temperature": 0.2, "top_p": 0.9, "max_tokens": 8, "stop": ["\n"],
                         "seed": 3, "presence_penalty": 0.0, "frequency_penalty": 0.5,
                         "logit_bias": {"42": -100.0}, "logprobs": True, "top_logprobs": 2},
            "stream": True, "include_usage": True, "created": 1700000000,
            "store": True, "metadata": {"run": "nightly"}, "api": "chat.completions",
            "response_format": {"type": "json_schema", "name": "answer", "strict": True,
                                "schema": '{"type": "object"}'},
            "tools": {"functions": [{"name": "f", "description": "d", "parameters": "",
                                     "strict": False}],
                      "choice": "auto", "function": "", "parallel": True},
        },
    )


def test_round_trip_every_field() -> None:
    codec = default_codec()
    event = request()
    data = codec.encode("Request", event)
    assert data[:2] == MAGIC
    assert codec.decode(data, "Request") == event


def test_every_event_type_has_a_current_schema() -> None:
    codec = Codec()
    for name in EVENT_TYPES:
        assert codec.schema(name)["name"] == f"conveyor.{name}"


def test_an_event_written_with_the_previous_schema_is_still_read() -> None:
    codec = default_codec()
    v1 = parse_schema(json.loads((HISTORY / "conveyor.Request.v1.avsc").read_text()),
                      _write_hint=False)
    old = {
        "envelope": {"request_id": "old-1", "tenant": "acme", "traceparent": "", "attempt": 0,
                     "reply_gateway": "gw", "reply_partition": 1, "stamps": {"gateway": 5}},
        "generation": {
            "kind": "completion", "model": "smollm2", "messages": [], "prompt": "Once",
            "sampling": {"temperature": 0.7, "top_p": 1.0, "max_tokens": 16, "stop": [],
                         "seed": None},
            "stream": False,
        },
    }
    data = codec.encode_with(v1, old)
    event = codec.decode(data, "Request")
    # what v1 had is kept; what it lacked takes the current schema's defaults
    assert event["envelope"]["tenant"] == "acme"
    assert event["envelope"]["deadline_ms"] == 0 and event["envelope"]["priority"] == 0
    assert event["generation"]["prompt"] == "Once"
    assert event["generation"]["include_usage"] is False
    assert event["generation"]["created"] == 0
    assert event["generation"]["sampling"]["frequency_penalty"] == 0.0


def test_history_schemas_are_registered_by_fingerprint() -> None:
    codec = Codec()
    for path in HISTORY.glob("*.avsc"):
        assert codec.register_writer(path) in EVENT_TYPES


@pytest.mark.parametrize("data", [b"", b"garbage", MAGIC + b"\x00" * 8 + b"\x01",
                                  None])
def test_poison_values_raise_schema_error(data: bytes | None) -> None:
    with pytest.raises(SchemaError):
        default_codec().decode(data, "Request")


def test_a_value_of_another_type_is_refused() -> None:
    codec = default_codec()
    data = codec.encode("Request", request())
    with pytest.raises(SchemaError, match="expected a Reply"):
        codec.decode(data, "Reply")


def test_truncated_body_is_a_schema_error() -> None:
    codec = default_codec()
    data = codec.encode("Request", request())
    with pytest.raises(SchemaError):
        codec.decode(data[:20], "Request")


def test_encoding_a_wrong_record_is_a_schema_error() -> None:
    with pytest.raises(SchemaError):
        default_codec().encode("Request", {"envelope": {}})
