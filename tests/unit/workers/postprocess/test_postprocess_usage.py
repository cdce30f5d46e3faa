"""PostprocessLayer.handle writes one UsageRecord per request that ends: no Kafka,
the real codec (every output is encoded and decoded again)."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import ChunkHeader, ErrorInfo, Prompt, TokenChunk, UsageRecord
from tests.support.factories import Record, request
from topics.envelope import new_envelope, now_ms
from workers.outputs import Output
from workers.postprocess import PostprocessLayer
from workers.prompt_cache import chunk_header

TENANT = "acme"
KEY_ID = "key-7"
ENTERED_US = 1_790_000_000_123_456


@pytest.fixture
def settings() -> Settings:
    return load_settings(topic_prefix="pp-usage")


@pytest.fixture
def layer(settings: Settings) -> PostprocessLayer:
    return PostprocessLayer(settings)


def chunk(seq: int, text: str = "", *, tokens: int = 1, finish: str | None = None,
          rid: str = "r1", stop: list[str] | None = None,
          error: ErrorInfo | None = None, header: bool = True) -> TokenChunk:
    envelope = new_envelope(rid, reply_gateway="g", reply_partition=2, tenant=TENANT,
                            key_id=KEY_ID)
    envelope["stamps"]["gateway"] = ENTERED_US
    head = ChunkHeader(kind="completion", model="smollm2", created=1_700_000_000,
                       stop=stop or [], stream=False, include_usage=False, prompt_tokens=11)
    return TokenChunk(envelope=envelope, seq=seq, text=text, tokens=tokens,
                      finish_reason=finish, worker_id="w0",
                      header=head if seq == 0 and header else None, error=error,
                      run_id="run-1", run_start=0)


class Feeder:
    def __init__(self, layer: PostprocessLayer) -> None:
        self.layer = layer
        self.tp = TopicPartition(layer.source.at(layer.settings.kafka), 0)
        self.offset = 0
        self.codec = default_codec()

    async def __call__(self, event: TokenChunk) -> list[Output]:
        record = Record(self.tp.topic, self.tp.partition, self.offset)
        self.offset += 1
        outputs = await self.layer.handle(event, record)
        for out in outputs:
            data = self.codec.encode(out.event_type, out.record)
            assert self.codec.decode(data, out.event_type) == out.record
        return outputs


def usage(outputs: list[Output]) -> list[UsageRecord]:
    return [o.record for o in outputs if o.event_type == "UsageRecord"]


ERROR = ErrorInfo(status=500, type="server_error", code="engine_error", param=None,
                  message="the engine failed")


async def test_a_finished_request_writes_one_usage_record_keyed_by_tenant(
        layer: PostprocessLayer, settings: Settings) -> None:
    feed = Feeder(layer)
    before = now_ms()
    outputs = [*await feed(chunk(0, "Hel", tokens=2)), *await feed(chunk(1, "lo", tokens=3)),
               *await feed(chunk(2, "!", tokens=1, finish="length"))]
    records = [o for o in outputs if o.event_type == "UsageRecord"]
    assert len(records) == 1
    out = records[0]
    assert out.topic == settings.kafka.topic("usage")
    assert out.key == TENANT and out.partition is None
    rec = out.record
    assert {k: v for k, v in rec.items() if k not in ("finished_ms", "first_token_ms")} == {
        "request_id": "r1", "tenant": TENANT, "key_id": KEY_ID, "model": "smollm2",
        "kind": "completion", "status": "completed", "prompt_tokens": 11,
        "completion_tokens": 6, "entered_ms": ENTERED_US // 1000, "error_code": None,
        "asked_model": ""}
    assert rec["finished_ms"] >= before
    first = rec.get("first_token_ms")
    assert first is not None and before <= first <= rec["finished_ms"]
    # the record travels with the final reply, and its counts are the reply's usage
    final = [o.record for o in outputs if o.event_type == "Reply" and
             o.record["kind"] == "final"]
    assert len(final) == 1
    assert final[0]["usage"] == {"prompt_tokens": 11, "completion_tokens": 6, "cached_tokens": 0}


async def test_a_replayed_end_writes_no_second_record(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    assert len(usage(await feed(chunk(0, "a", finish="stop")))) == 1
    assert await feed(chunk(0, "a", finish="stop")) == []


async def test_an_early_stop_sequence_counts_once_with_its_cancel(
        layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    assert usage(await feed(chunk(0, "one ", tokens=2, stop=["STOP"]))) == []
    outputs = await feed(chunk(1, "two STOP three", tokens=4))
    assert [o.event_type for o in outputs].count("Control") == 1
    records = usage(outputs)
    assert len(records) == 1
    assert records[0]["status"] == "completed" and records[0]["completion_tokens"] == 6


async def test_an_error_before_any_token_counts_the_request_with_no_completion(
        layer: PostprocessLayer, settings: Settings) -> None:
    feed = Feeder(layer)
    outputs = await feed(chunk(0, tokens=0, error=ERROR))
    assert [o.record["kind"] for o in outputs if o.event_type == "Reply"] == ["error"]
    records = [o for o in outputs if o.event_type == "UsageRecord"]
    assert len(records) == 1
    assert records[0].key == TENANT and records[0].topic == settings.kafka.topic("usage")
    rec = records[0].record
    assert rec["status"] == "error"
    assert rec["completion_tokens"] == 0 and rec["prompt_tokens"] == 11
    assert rec["tenant"] == TENANT and rec["key_id"] == KEY_ID and rec["model"] == "smollm2"
    assert rec["error_code"] == ERROR["code"]  # what the console searches failures by


async def test_an_error_mid_stream_counts_the_tokens_generated_before_it(
        layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    assert usage(await feed(chunk(0, "par", tokens=3))) == []
    records = usage(await feed(chunk(1, tokens=0, error=ERROR)))
    assert len(records) == 1
    assert records[0]["status"] == "error" and records[0]["completion_tokens"] == 3


async def test_an_error_without_a_header_still_names_the_tenant(
        layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    records = usage(await feed(chunk(0, tokens=0, error=ERROR, header=False, rid="r9")))
    assert len(records) == 1
    assert records[0]["request_id"] == "r9" and records[0]["tenant"] == TENANT
    assert records[0]["model"] == "" and records[0]["prompt_tokens"] == 0


async def test_the_first_token_is_the_first_chunk_with_generated_text(
        layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    # a chunk with the header and nothing generated yet is no first token
    assert usage(await feed(chunk(0, "", tokens=0))) == []
    assert layer.streams["r1"].first_token_ms is None
    before = now_ms()
    assert usage(await feed(chunk(1, "Hi", tokens=1))) == []
    first = layer.streams["r1"].first_token_ms
    assert first is not None and first >= before
    records = usage(await feed(chunk(2, "!", tokens=1, finish="stop")))
    assert records[0].get("first_token_ms") == first


async def test_an_error_before_any_token_has_no_first_token(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    records = usage(await feed(chunk(0, tokens=0, error=ERROR)))
    assert records[0].get("first_token_ms") is None


async def test_a_fallback_s_answer_is_counted_under_it_naming_the_model_asked_for(
        layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    first = chunk(0, "par", tokens=2, finish="stop")
    assert first["header"] is not None
    first["header"] |= {"model": "bigger", "asked": "smollm2"}  # as the worker wrote it
    [record] = usage(await feed(first))
    assert (record["model"], record["asked_model"]) == ("bigger", "smollm2")


def test_a_header_names_the_model_asked_for_only_when_another_answers() -> None:
    asked = request()["generation"]
    prompt = Prompt(text=None, tokens=3, exact=True, max_tokens=16, dropped_messages=0,
                    fingerprint="", prefix_blocks=[])
    assert chunk_header(asked, asked["model"], prompt).get("asked") == ""
    assert chunk_header(asked, "bigger", prompt).get("asked") == asked["model"]
