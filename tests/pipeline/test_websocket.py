"""The WebSocket endpoints through the whole pipeline, driven by a real client
(``websockets``): multiplexed generations with a cancel, refusals that keep the
connection, a frame that closes it, and the Responses API's WebSocket mode."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from schemas.codec import default_codec
from tests.pipeline.test_responses_continued import turns_asked
from tests.support.pipeline import Pipeline

LONG = "Count from 1 to 300, one number per line."
SHORT = "What is the capital of France?"


def ws_url(p: Pipeline, path: str) -> str:
    return p.base_url.replace("http://", "ws://") + path


def chat(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": "smollm2", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}


async def cancels_on_control(p: Pipeline, wanted: str, within_s: float = 15.0) -> set[str]:
    """The request ids cancelled on ``conveyor.control``, read until ``wanted`` is
    among them or ``within_s`` passes."""
    consumer = AIOKafkaConsumer(p.settings.kafka.topic("control"),
                                bootstrap_servers=p.settings.kafka.bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + within_s
        while wanted not in seen and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                seen.update(default_codec().decode(r.value, "Control")["request_id"]
                            for r in records)
    finally:
        await consumer.stop()
    return seen


async def receive(ws: ClientConnection) -> dict[str, Any]:
    message: dict[str, Any] = json.loads(await ws.recv())
    return message


async def test_three_multiplexed_requests_one_cancelled(pipeline: Pipeline) -> None:
    bodies = {"a": chat(SHORT, 24), "b": chat(LONG, 400), "c": chat(SHORT, 24)}
    chunks: dict[str, list[dict[str, Any]]] = {rid: [] for rid in bodies}
    ends: dict[str, dict[str, Any]] = {}
    after_end: list[dict[str, Any]] = []
    async with connect(ws_url(pipeline, "/v1/chat/completions"), open_timeout=10) as ws:
        for rid, body in bodies.items():
            await ws.send(json.dumps({"type": "request", "id": rid, "body": body}))
        cancelled = False
        while len(ends) < 3:
            message = await receive(ws)
            rid = message["id"]
            if rid in ends:
                after_end.append(message)
            elif message["type"] == "chunk":
                chunks[rid].append(message["data"])
                if rid == "b" and not cancelled:
                    await ws.send(json.dumps({"type": "cancel", "id": "b"}))
                    cancelled = True
            else:
                ends[rid] = message
    assert after_end == []
    assert ends["a"] == {"type": "done", "id": "a"} and ends["c"] == {"type": "done", "id": "c"}
    assert ends["b"]["type"] == "error" and ends["b"]["error"]["code"] == "request_cancelled"
    for rid in ("a", "c"):
        assert {c["object"] for c in chunks[rid]} == {"chat.completion.chunk"}
        assert len({c["id"] for c in chunks[rid]}) == 1
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in chunks[rid] if c["choices"])
        assert text.strip()
        assert chunks[rid][-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len({chunks[rid][0]["id"] for rid in bodies}) == 3
    assert chunks["b"] and all(c["choices"][0]["finish_reason"] is None
                               for c in chunks["b"] if c["choices"])
    # the cancel reached the pipeline, for b alone
    rids = {rid: chunks[rid][0]["id"].removeprefix("chatcmpl-") for rid in bodies}
    cancelled_ids = await cancels_on_control(pipeline, rids["b"])
    assert rids["b"] in cancelled_ids
    assert rids["a"] not in cancelled_ids and rids["c"] not in cancelled_ids


async def test_a_bad_request_is_an_error_for_its_id_and_a_bad_frame_closes(
        pipeline: Pipeline) -> None:
    async with connect(ws_url(pipeline, "/v1/completions"), open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "request", "id": "bad",
                                  "body": {"model": "smollm2", "prompt": 7}}))
        bad = await receive(ws)
        assert bad["type"] == "error" and bad["id"] == "bad" and bad["status"] == 400
        assert bad["error"]["param"] == "prompt"
        await ws.send(json.dumps({"type": "request", "id": "ghost",
                                  "body": {"model": "nope", "prompt": "x"}}))
        ghost = await receive(ws)
        assert ghost["status"] == 404 and ghost["error"]["code"] == "model_not_found"
        await ws.send(json.dumps({"type": "request", "id": "ok",
                                  "body": {"model": "smollm2", "prompt": "Paris is",
                                           "max_tokens": 4, "temperature": 0}}))
        kinds = []
        while not kinds or kinds[-1] == "chunk":
            message = await receive(ws)
            assert message["id"] == "ok"
            kinds.append(message["type"])
            if message["type"] == "chunk":
                assert message["data"]["object"] == "text_completion"
        assert kinds[-1] == "done" and len(kinds) > 1
        await ws.send("not json")
        with pytest.raises(ConnectionClosed) as caught:
            await ws.recv()
    assert caught.value.rcvd is not None
    assert caught.value.rcvd.code == 1007 and "not JSON" in caught.value.rcvd.reason


async def test_a_responses_round_trip(pipeline: Pipeline) -> None:
    async with connect(ws_url(pipeline, "/v1/responses"), open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "response.create", "model": "smollm2",
                                  "input": SHORT, "max_output_tokens": 16,
                                  "temperature": 0}))
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] not in (
                "response.completed", "response.incomplete", "response.failed"):
            events.append(await receive(ws))
        await ws.send(json.dumps({"type": "response.create", "model": "smollm2",
                                  "input": SHORT, "background": True}))
        refused = await receive(ws)
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    assert deltas.strip() and done["text"] == deltas
    assert events[0]["response"]["id"] == events[-1]["response"]["id"]
    assert refused["type"] == "error" and refused["param"] == "background"
    assert refused["status"] == 400


async def test_a_responses_socket_continues_a_response_by_its_id(pipeline: Pipeline) -> None:
    """WebSocket mode's usual chaining: each create names the previous response,
    whose conversation comes first, read from the log; an unknown one is an
    error event naming the parameter."""

    async def create(ws: ClientConnection, **fields: Any) -> list[dict[str, Any]]:
        await ws.send(json.dumps({"type": "response.create", "model": "smollm2",
                                  "max_output_tokens": 4, **fields}))
        events = [await receive(ws)]
        while events[-1]["type"] not in ("response.completed", "response.incomplete",
                                         "response.failed", "error"):
            events.append(await receive(ws))
        return events

    async with connect(ws_url(pipeline, "/v1/responses"), open_timeout=10) as ws:
        first = (await create(ws, input="Count to 3."))[-1]["response"]
        second = (await create(ws, input="Go on.", previous_response_id=first["id"]))[-1]
        missing = (await create(ws, input="Hi", previous_response_id="resp_" + "0" * 32))[-1]
    assert second["response"]["previous_response_id"] == first["id"]
    first_text = first["output"][0]["content"][0]["text"]
    assert await turns_asked(pipeline, second["response"]["id"]) == [
        ("user", "Count to 3."), ("assistant", first_text), ("user", "Go on.")]
    assert missing["type"] == "error" and missing["status"] == 404
    assert missing["param"] == "previous_response_id"
