"""The codec: single-object encoding, schema evolution, poison detection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form

from conveyor.errors import SchemaError
from schemas.codec import EVENT_TYPES, MAGIC, Codec, default_codec, learn_writers
from schemas.records import Request
from tests.support.factories import encoded_with
from topics.envelope import new_envelope

AVRO = Path(__file__).resolve().parents[3] / "schemas" / "avro"


def request() -> Request:
    return Request(
        envelope=new_envelope("r1", reply_gateway="gw", reply_partition=2, deadline_ms=99,
                              priority=1),
        generation={
            "kind": "chat", "model": "smollm2",
            "messages": [{"role": "user", "content": "héllo", "name": None,
                          "tool_calls": None, "tool_call_id": None,
                          "images": [{"file_id": "file-0123456789abcdef01234567",
                                      "media_type": "image/png", "bytes": 67,
                                      "sha256": "ab" * 32, "width": 1, "height": 1,
                                      "detail": "low", "offset": 2,
                                      "part": "messages[0].content[1]"}]},
                         {"role": "assistant", "content": "", "name": None,
                          "tool_calls": [{"id": "call_1", "name": "f", "arguments": "{}"}],
                          "tool_call_id": None, "images": None},
                         {"role": "tool", "content": "42", "name": None, "tool_calls": None,
                          "tool_call_id": "call_1", "images": None}],
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
            "previous_response_id": "resp_01a2", "history_messages": 2,
            "embedding": None,
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


def older(schema: Any, dropped: dict[str, set[str]]) -> Any:
    """The schema an older producer wrote: ``schema`` in its parsing canonical
    form with the ``dropped`` fields of each named record left out."""
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        node = {k: walk(v) for k, v in node.items()}
        if node.get("type") == "record":
            gone = dropped.get(node["name"], set())
            node["fields"] = [f for f in node["fields"] if f["name"] not in gone]
        return node
    return walk(json.loads(to_parsing_canonical_form(schema)))


def test_an_event_written_with_a_schema_kept_in_history_is_read(tmp_path: Path) -> None:
    avro = tmp_path / "avro"
    shutil.copytree(AVRO, avro, ignore=shutil.ignore_patterns("history"))
    v1 = older(default_codec().schema("Request"),
               {"conveyor.Envelope": {"deadline_ms", "priority"},
                "conveyor.Generation": {"include_usage", "created"},
                "conveyor.Message": {"images"}})
    (avro / "history").mkdir()
    data = encoded_with(parse_schema(v1, _write_hint=False), request())
    with pytest.raises(SchemaError, match="unknown schema fingerprint"):
        Codec(avro).decode(data, "Request")  # the history is what makes it readable
    (avro / "history" / "conveyor.Request.v1.avsc").write_text(json.dumps(v1))
    event = Codec(avro).decode(data, "Request")
    # what v1 had is kept; what it lacked takes the current schema's defaults
    assert event["envelope"]["reply_gateway"] == "gw"
    assert event["envelope"]["deadline_ms"] == 0 and event["envelope"]["priority"] == 0
    assert event["generation"]["messages"] == [
        {**m, "images": None} for m in request()["generation"]["messages"]]
    assert event["generation"]["include_usage"] is False
    assert event["generation"]["created"] == 0
    assert event["generation"]["sampling"]["frequency_penalty"] == 0.5


def test_a_usage_record_written_before_first_token_ms_reads_with_none() -> None:
    v1 = json.loads((AVRO / "history" / "conveyor.UsageRecord.v1.avsc").read_text())
    old = {"request_id": "r1", "tenant": "acme", "key_id": "k1", "model": "m", "kind": "chat",
           "status": "completed", "prompt_tokens": 3, "completion_tokens": 4,
           "entered_ms": 1_000, "finished_ms": 2_000}
    event = default_codec().decode(encoded_with(parse_schema(v1, _write_hint=False), old),
                                   "UsageRecord")
    assert event == {**old, "first_token_ms": None, "error_code": None, "asked_model": ""}
    # today's record carries it, and one written without it is null
    now = default_codec().encode("UsageRecord", {**old, "first_token_ms": 1_500})
    assert default_codec().decode(now, "UsageRecord")["first_token_ms"] == 1_500
    bare = default_codec().encode("UsageRecord", old)
    assert default_codec().decode(bare, "UsageRecord")["first_token_ms"] is None


def test_history_schemas_are_registered_by_fingerprint() -> None:
    codec = Codec()
    for path in (AVRO / "history").glob("*.avsc"):
        assert codec.register_writer(path) in EVENT_TYPES


def test_a_process_learns_a_newer_version_from_its_schema_history(tmp_path: Path) -> None:
    """A process not upgraded yet, given the new version's schema, reads the
    events of those that are (the extra field is passed over)."""
    schema = json.loads(to_parsing_canonical_form(default_codec().schema("Request")))
    schema["fields"].append({"name": "learned_in_a_test", "type": "string"})
    (tmp_path / "conveyor.Request.v98.avsc").write_text(json.dumps(schema))
    newer = encoded_with(parse_schema(schema, _write_hint=False),
                         dict(request()) | {"learned_in_a_test": "x"})
    with pytest.raises(SchemaError, match="unknown schema fingerprint"):
        default_codec().decode(newer, "Request")
    try:
        assert learn_writers(tmp_path) == ["Request"]
        assert default_codec().decode(newer, "Request")["envelope"]["request_id"] == "r1"
    finally:
        default_codec.cache_clear()  # the other tests' codec knows only what ships
    with pytest.raises(SchemaError, match="is not a folder"):
        learn_writers(tmp_path / "missing")


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
