"""PostprocessLayer.handle on hand-built token chunks: no Kafka, the real codec."""

from __future__ import annotations

import json
from typing import Any, Literal, cast

import pytest
from aiokafka import TopicPartition

from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import ChunkHeader, ErrorInfo, TokenChunk
from tests.support.factories import Record
from topics.envelope import new_envelope
from workers.outputs import Output
from workers.postprocess import PostprocessLayer

REPLY_PARTITION = 3


@pytest.fixture
def settings() -> Settings:
    return load_settings()


@pytest.fixture
def layer(settings: Settings) -> PostprocessLayer:
    return PostprocessLayer(settings)


def chunk(seq: int, text: str = "", *, tokens: int = 1, finish: str | None = None,
          rid: str = "r1", kind: Literal["chat", "completion"] = "chat",
          stop: list[str] | None = None, include_usage: bool = False,
          error: ErrorInfo | None = None, deadline_ms: int = 0) -> TokenChunk:
    header = ChunkHeader(kind=kind, model="smollm2", created=1_700_000_000, stop=stop or [],
                         stream=True, include_usage=include_usage, prompt_tokens=11)
    envelope = new_envelope(rid, reply_gateway="g", reply_partition=REPLY_PARTITION,
                            deadline_ms=deadline_ms)
    return TokenChunk(envelope=envelope, seq=seq, text=text, tokens=tokens,
                      finish_reason=finish, worker_id="w0",
                      header=header if seq == 0 else None, error=error)


class Feeder:
    """Hands chunks to the layer as records of one tokens partition, offsets counting up."""

    def __init__(self, layer: PostprocessLayer, partition: int = 0) -> None:
        self.layer = layer
        self.tp = TopicPartition(layer.source.at(layer.settings.kafka), partition)
        self.offset = 0

    async def __call__(self, event: TokenChunk) -> list[Output]:
        record = Record(self.tp.topic, self.tp.partition, self.offset)
        self.offset += 1
        outputs = await self.layer.handle(event, record)
        encode_all(outputs)
        return outputs


def encode_all(outputs: list[Output]) -> None:
    codec = default_codec()
    for out in outputs:
        decoded = codec.decode(codec.encode(out.event_type, out.record), out.event_type)
        assert decoded == out.record


def replies(outputs: list[Output]) -> list[dict[str, Any]]:
    return [o.record for o in outputs if o.event_type == "Reply"]


async def test_replies_go_to_the_gateways_partition_with_increasing_index(
        layer: PostprocessLayer, settings: Settings) -> None:
    feed = Feeder(layer)
    outputs = [*await feed(chunk(0, "Hel")), *await feed(chunk(1, "lo")),
               *await feed(chunk(2, "!", finish="stop"))]
    assert outputs
    # the final chunk also yields the request's usage record (test_usage_output.py)
    outputs = [o for o in outputs if o.event_type == "Reply"]
    for out in outputs:
        assert out.topic == settings.kafka.topic("replies")
        assert out.partition == REPLY_PARTITION
        assert out.key == "r1"
    assert [r["index"] for r in replies(outputs)] == list(range(len(outputs)))
    assert "".join(r["text"] for r in replies(outputs)) == "Hello!"
    assert "postprocess" in replies(outputs)[0]["envelope"]["stamps"]


async def test_only_a_streams_first_and_last_replies_carry_the_stamps(
        layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    middle = chunk(1, "lo")
    middle["envelope"]["stamps"] = {}  # as a worker writes a chunk between its first and last
    outputs = [*await feed(chunk(0, "Hel")), *await feed(middle), *await feed(chunk(2, "!")),
               *await feed(chunk(3, "", finish="stop"))]
    sent = replies(outputs)
    assert [r["kind"] for r in sent] == ["delta", "delta", "delta", "final"]
    assert {"gateway", "postprocess"} <= set(sent[0]["envelope"]["stamps"])
    assert [r["envelope"]["stamps"] for r in sent[1:3]] == [{}, {}]
    assert sent[-1]["envelope"]["stamps"] == sent[0]["envelope"]["stamps"]
    # everything else of the envelope travels with every reply
    assert all(r["envelope"]["reply_gateway"] == "g" and r["envelope"]["request_id"] == "r1"
               and r["envelope"]["traceparent"] == sent[0]["envelope"]["traceparent"]
               for r in sent)


async def test_a_chat_request_starts_with_a_role_chunk(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    first = replies(await feed(chunk(0, "Hi")))
    # one reply per chunk: the role chunk and the content chunk travel together
    assert [r["kind"] for r in first] == ["delta"]
    role, content = (json.loads(line) for line in first[0]["chunk"].split("\n"))
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first[0]["text"] == "Hi"
    assert content["choices"][0]["delta"] == {"content": "Hi"}
    # only once
    second = replies(await feed(chunk(1, " there")))
    assert len(second) == 1 and "role" not in second[0]["chunk"]


async def test_the_role_chunk_goes_out_even_when_the_first_text_is_held(
        layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    first = replies(await feed(chunk(0, "EN", stop=["END"])))
    assert len(first) == 1
    assert json.loads(first[0]["chunk"])["choices"][0]["delta"]["role"] == "assistant"


async def test_a_completion_request_has_no_role_chunk(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    first = replies(await feed(chunk(0, "Once", kind="completion")))
    assert len(first) == 1
    body = json.loads(first[0]["chunk"])
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Once"


async def test_the_final_reply_carries_the_usage(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    await feed(chunk(0, "a", tokens=2))
    out = replies(await feed(chunk(1, "b", tokens=3, finish="length")))
    assert [r["kind"] for r in out] == ["final"]
    final = out[0]
    assert final["finish_reason"] == "length" and final["text"] == "b"
    content, finish = (json.loads(line) for line in final["chunk"].split("\n"))
    assert content["choices"][0]["delta"] == {"content": "b"}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert final["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "cached_tokens": 0}
    # no usage chunk unless the client asked for one


async def test_include_usage_gives_the_final_reply_a_usage_chunk(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    out = replies(await feed(chunk(0, "a", tokens=4, finish="stop", include_usage=True)))
    final = out[-1]
    assert final["kind"] == "final"
    *others, last = [json.loads(line) for line in final["chunk"].split("\n")]
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert others and all(body["usage"] is None for body in others)


async def test_the_engines_cached_prompt_tokens_reach_the_usage(
        layer: PostprocessLayer) -> None:
    """The run's last chunk says how many prompt tokens the engine's prefix cache
    held; never more than the prompt's (a continued answer's prompt is longer)."""
    feed = Feeder(layer)
    last = {**chunk(0, "a", tokens=4, finish="stop", include_usage=True), "cached_tokens": 8}
    final = replies(await feed(cast(TokenChunk, last)))[-1]
    assert final["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "cached_tokens": 8}
    usage = json.loads(final["chunk"].split("\n")[-1])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 8}
    feed = Feeder(layer)
    last = {**chunk(0, "b", rid="r2", finish="stop"), "cached_tokens": 40}
    final = replies(await feed(cast(TokenChunk, last)))[-1]
    assert final["usage"]["cached_tokens"] == 11


async def test_an_early_stop_sequence_cancels_the_generation(
        layer: PostprocessLayer, settings: Settings) -> None:
    feed = Feeder(layer)
    await feed(chunk(0, "one ", stop=["STOP"]))
    outputs = await feed(chunk(1, "two STOP three"))
    controls = [o for o in outputs if o.event_type == "Control"]
    assert len(controls) == 1
    control = controls[0]
    assert control.topic == settings.kafka.topic("control")
    assert control.key == "r1"
    assert control.record["request_id"] == "r1" and control.record["action"] == "cancel"
    rs = replies(outputs)
    assert "".join(r["text"] for r in rs) == "two "
    assert [r["finish_reason"] for r in rs if r["finish_reason"]] == ["stop"]
    assert rs[-1]["kind"] == "final"


async def test_a_stop_in_the_last_chunk_sends_no_cancel(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    outputs = await feed(chunk(0, "a STOP", finish="stop", stop=["STOP"]))
    assert [o.event_type for o in outputs if o.event_type != "UsageRecord"] == \
        ["Reply"] * (len(outputs) - 1)


async def test_chunks_after_the_finish_produce_nothing(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    first = await feed(chunk(0, "a", finish="stop"))
    assert first
    assert await feed(chunk(0, "a", finish="stop")) == []  # a replayed duplicate
    assert await feed(chunk(1, "", finish="cancelled")) == []  # the worker's late chunk
    assert "r1" not in layer.streams


async def test_a_duplicate_chunk_in_flight_produces_nothing(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    await feed(chunk(0, "a"))
    assert await feed(chunk(0, "a")) == []


async def test_an_error_chunk_becomes_an_error_reply(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    err = ErrorInfo(status=504, type="timeout", code="deadline_exceeded", param=None,
                    message="The request's deadline passed.")
    out = replies(await feed(chunk(0, error=err)))
    assert [(r["kind"], r["index"], r["error"]) for r in out] == [("error", 0, err)]
    assert "r1" not in layer.streams


async def test_committable_holds_at_the_first_chunk_of_an_open_request(
        layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    tp = feed.tp
    feed.offset = 10
    await feed(chunk(0, "a", rid="open"))  # offset 10
    await feed(chunk(0, "b", rid="other", finish="stop"))  # offset 11, finished at once
    await feed(chunk(1, "c", rid="open"))  # offset 12
    assert layer.committable(tp, 13) == 10
    # another partition is not held back by it
    assert layer.committable(TopicPartition(tp.topic, 1), 5) == 5
    await feed(chunk(2, "", rid="open", finish="stop"))  # offset 13
    assert layer.committable(tp, 14) == 14


async def test_committable_follows_the_oldest_open_request(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    await feed(chunk(0, "a", rid="x"))  # offset 0
    await feed(chunk(0, "a", rid="y"))  # offset 1
    assert layer.committable(feed.tp, 2) == 0
    await feed(chunk(1, "", rid="x", finish="stop"))  # offset 2
    assert layer.committable(feed.tp, 3) == 1
    await feed(chunk(1, "", rid="y", finish="stop"))  # offset 3
    assert layer.committable(feed.tp, 4) == 4


async def test_a_request_long_past_its_deadline_no_longer_holds_commits(
        layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    await feed(chunk(0, "a", rid="dead", deadline_ms=1))
    assert layer.committable(feed.tp, 1) == 1
    assert "dead" not in layer.streams


async def test_out_of_order_chunks_are_replied_in_order(layer: PostprocessLayer) -> None:
    feed = Feeder(layer)
    assert await feed(chunk(1, "b")) == []
    out = replies(await feed(chunk(0, "a")))
    assert [r["text"] for r in out] == ["a", "b"]
    assert [r["index"] for r in out] == [0, 1]


async def test_an_answer_read_for_tool_calls_streams_openai_tool_call_deltas(
        layer: PostprocessLayer) -> None:
    """The calls the model wrote (schemas/tools.py) stream as OpenAI's deltas: a
    call's id, type and name first, its arguments in pieces, and the answer
    finishes with tool_calls; the job of the gateway to fold the text is the
    same reading, so the streamed and the whole answer agree."""
    from schemas.openai.chunks import full_response

    feed = Feeder(layer)
    pieces = ["<tool_call>\n{\"name\": \"get_wea", "ther\", \"arguments\": {\"ci",
              "ty\": \"Paris\"}}\n</tool_", "call>"]
    outputs: list[Output] = []
    for seq, text in enumerate(pieces):
        first = chunk(seq, text, finish="stop" if seq == len(pieces) - 1 else None)
        if first["header"] is not None:
            first["header"]["tool_calls"] = True
        outputs += await feed(first)
    frames = [json.loads(line) for r in replies(outputs) for line in r["chunk"].split("\n")]
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[0]["id"].startswith("call_") and all("id" not in c for c in calls[1:])
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert not any(d.get("content") for d in deltas)
    assert frames[-1]["choices"][0]["finish_reason"] == "tool_calls"
    text = "".join(r["text"] for r in replies(outputs))
    whole = full_response("chat", "m", 0, "r1", text, "stop", None, tool_calls=True)
    assert whole["choices"][0]["message"]["tool_calls"][0] == {
        "id": calls[0]["id"], "type": "function",
        "function": {"name": "get_weather", "arguments": arguments}}
