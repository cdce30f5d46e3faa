"""Resuming a Responses stream, the parts that need no model: the one loop of
events both transports use, the request a resumed stream echoes, the grace a
dropped stream gets (on the real Redis), the route's dispatch, and a resumed
stream read from the real Kafka (a Request event and replies written there by
hand, as the gateway and postprocess write them)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from fastapi.testclient import TestClient
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from conveyor.errors import InvalidRequest, RequestError
from conveyor.registry import Registry
from conveyor.settings import Settings, load_settings
from gateway.answer import Answer
from gateway.app import build_app
from gateway.auth.types import Identity
from gateway.cancels import ResumeWatch
from gateway.replies import ReplyStream
from gateway.responses.objects import response_object
from gateway.responses.serving import (
    ResponseNotFound,
    ResponsesServing,
    generation_of,
    recorded_request,
    response_events,
    response_request_id,
)
from schemas.codec import default_codec
from schemas.openai.responses import ResponsesRequest, parse_request
from schemas.records import ErrorInfo, Generation, Reply, Request, Usage
from tests.support.gateway_fakes import (
    RecordingProducer,
    Router,
    offline_services,
    responses_serving,
)
from tests.support.pipeline import TEST_MODELS, drop_topics
from topics.admin import ensure_topics
from topics.catalog import REPLIES, catalog
from topics.clients import make_producer
from topics.envelope import new_envelope
from topics.lookup import SharedLookup
from topics.reader import request_ids_header

EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = Usage(prompt_tokens=5, completion_tokens=3)


def body(**fields: Any) -> ResponsesRequest:
    return parse_request(json.dumps({"model": "smollm2", "input": "Hi", "stream": True,
                                     **fields}).encode())


def reply(index: int, kind: str, text: str = "", finish: str | None = None,
          usage: Usage | None = None, error: ErrorInfo | None = None, rid: str = "r1",
          partition: int = 0) -> Reply:
    return Reply(envelope=new_envelope(rid, reply_gateway="g", reply_partition=partition),
                 index=index, kind=kind, text=text, chunk="",  # type: ignore[typeddict-item]
                 finish_reason=finish, usage=usage, error=error)


def parsed(frames: list[bytes]) -> list[Any]:
    """The events of SSE frames (keep-alive comments left out), each checked
    against the official client's types."""
    out = []
    for raw in frames:
        if raw.startswith(b":"):
            continue
        name, data, _ = raw.split(b"\n", 2)
        event = EVENT.validate_python(json.loads(data.removeprefix(b"data: ")))
        assert name == b"event: " + event.type.encode()
        out.append(event)
    return out


# -- the one loop ---------------------------------------------------------------

def serving(redis: aioredis.Redis | None = None, **settings: Any
            ) -> tuple[ResponsesServing, RecordingProducer]:
    producer = RecordingProducer()
    s = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}", **settings)
    return responses_serving(s, producer, redis), producer


async def events_of(replies: list[Reply], req: ResponsesRequest, pause_s: float = 0.0,
                    within: float | None = None) -> list[dict[str, Any] | None]:
    """What the loop yields for ``replies``, each put after ``pause_s``."""
    s, _ = serving()
    answer = Answer(ReplyStream("r1"), time.monotonic() + 5,
                    Router(), s.submitter.cancels)  # type: ignore[arg-type]

    async def feed() -> None:
        for r in replies:
            await asyncio.sleep(pause_s)
            answer.stream.put(r)

    feeder = asyncio.create_task(feed())
    out = [e async for e in response_events(answer, None, req, 1700000000, within,
                                            completed_at=lambda: 1700000009)]
    await feeder
    return out


async def test_the_events_are_a_function_of_the_replies_alone() -> None:
    req = body(instructions="Be brief.")
    replies = [reply(0, "delta", "Par"), reply(1, "delta", ""), reply(2, "delta", "is"),
               reply(3, "final", ".", "stop", USAGE)]
    at_once = await events_of(replies, req)
    waited = await events_of(replies, req, pause_s=0.15, within=0.05)
    assert None not in at_once and None in waited  # a wait is marked, never numbered
    assert [e for e in waited if e is not None] == at_once
    kinds = [e["type"] for e in at_once if e is not None]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in at_once if e is not None] == list(range(11))
    final = at_once[-1]
    assert final is not None and final["response"]["completed_at"] == 1700000009
    assert final["response"]["output"][0]["content"][0]["text"] == "Paris."


async def test_an_error_reply_ends_the_events_with_response_failed() -> None:
    req = body(instructions="Rules.", input=[{"role": "user", "content": "a"}])
    error = ErrorInfo(status=400, type="invalid_request_error", code=None,
                      param="messages[1].content", message="Invalid content.")
    out = await events_of([reply(0, "delta", "Par"), reply(1, "error", error=error)], req)
    failed = out[-1]
    assert failed is not None and failed["type"] == "response.failed"
    assert failed["sequence_number"] == 5 and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error",
                                           "message": "Invalid content."}


async def test_the_sse_stream_frames_the_loops_events() -> None:
    req = body()
    s, _ = serving()
    replies = [reply(0, "delta", "Par"), reply(1, "final", "is.", "stop", USAGE)]
    answer = Answer(ReplyStream("r1"), time.monotonic() + 5,
                    Router(), s.submitter.cancels)  # type: ignore[arg-type]
    for r in replies:
        answer.stream.put(r)
    first = await answer.next()
    assert first is not None
    frames = [f async for f in s.stream(generation_of(req), answer, req, first)]
    looped = await events_of(replies, req)
    sent = [json.loads(f.split(b"\ndata: ", 1)[1]) for f in frames]
    for a, b in zip(sent, looped, strict=True):
        assert b is not None
        if a["type"] in ("response.created", "response.in_progress", "response.completed"):
            a["response"]["created_at"] = b["response"]["created_at"]
            a["response"]["completed_at"] = b["response"]["completed_at"]
        assert a == b
    assert parsed(frames)[-1].response.output_text == "Paris."


# -- what a resumed stream echoes --------------------------------------------------

def test_a_resumed_stream_echoes_the_request_the_log_holds() -> None:
    for req in (body(instructions="Be brief.", temperature=0, top_p=0.5, max_output_tokens=9),
                body(input=[{"role": "developer", "content": "Dev."},
                            {"role": "user", "content": "Hi"}]),
                body()):
        g = generation_of(req)
        again = recorded_request(g)
        assert response_object("resp_r1", g["created"], again, "in_progress") == \
            response_object("resp_r1", g["created"], req, "in_progress")
    told = recorded_request(generation_of(body(instructions="Be brief.")))
    assert told.instructions == "Be brief." and len(told.input) == 1


def test_a_response_id_names_its_request() -> None:
    assert response_request_id("resp_0af9") == "0af9"
    for bad in ("0af9", "resp_", "resp_a/b", "resp_chatcmpl-0af9", "chatcmpl-0af9"):
        with pytest.raises(ResponseNotFound) as info:
            response_request_id(bad)
        assert info.value.status == 404 and bad in info.value.message


# -- the grace of a dropped stream, on the real Redis -------------------------------

async def dropped(s: ResponsesServing) -> None:
    """A Responses stream whose client leaves after its first event."""
    req = body()
    answer = Answer(ReplyStream("r1"), time.monotonic() + 5,
                    Router(), s.submitter.cancels)  # type: ignore[arg-type]
    frames = s.stream(generation_of(req), answer, req, reply(0, "delta", "Par"))
    assert (await frames.__anext__()).startswith(b"event: response.created\n")
    await frames.aclose()


async def test_a_dropped_stream_is_cancelled_after_the_grace(redis: aioredis.Redis) -> None:
    s, producer = serving(redis, resume_grace_s=0.4)
    await dropped(s)
    await asyncio.sleep(0.2)
    assert producer.cancelled() == []  # the client may still resume
    await asyncio.sleep(0.5)
    assert producer.cancelled() == ["r1"]


async def test_a_dropped_stream_resumed_in_the_grace_runs_on(redis: aioredis.Redis) -> None:
    s, producer = serving(redis, resume_grace_s=0.3)
    watch = ResumeWatch(s.settings, redis)
    await dropped(s)
    await watch.renew("r1", "replica-2")  # a replica serves the resumed stream
    try:
        await asyncio.sleep(0.6)
        assert producer.cancelled() == []
    finally:
        await redis.delete(watch.key("r1"))


async def test_without_resumable_streams_a_drop_cancels_at_once(redis: aioredis.Redis) -> None:
    s, producer = serving(redis, resume_grace_s=5.0, resumable_streams=False)
    await dropped(s)
    await asyncio.sleep(0.1)
    assert producer.cancelled() == ["r1"]


# -- the route --------------------------------------------------------------------

@dataclass
class Stored:
    """A background machinery holding one response."""

    held: dict[str, Any]
    asked: list[tuple[str, str]] = field(default_factory=list)

    async def retrieve(self, identity: Identity, response_id: str) -> dict[str, Any]:
        self.asked.append((identity.tenant, response_id))
        if response_id != self.held["id"]:
            raise RequestError(f"Response with id '{response_id}' not found.", status=404,
                               type="invalid_request_error", code="not_found")
        return self.held


@pytest.fixture(scope="module")
def http() -> TestClient:
    """The gateway's own application, without its pipeline (no lifespan runs)."""
    settings, registry = load_settings(topic_prefix="rr"), Registry.load(TEST_MODELS)
    app = build_app(settings, registry)
    app.state.services = offline_services(settings, registry)
    return TestClient(app)


def test_without_stream_the_route_is_the_background_retrieve(http: TestClient) -> None:
    held = response_object("resp_bg1", 1700000000, body(background=True, stream=False),
                           "queued")
    stored = Stored(held)
    responses = http.app.state.services.responses  # type: ignore[attr-defined]
    responses.background = stored
    try:
        assert http.get("/v1/responses/resp_bg1").json() == held
        assert http.get("/v1/responses/resp_bg1?stream=false").json() == held
        # not a background response, nor a response id at all: 404 without the log
        missing = http.get("/v1/responses/other")
    finally:
        responses.background = None
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert stored.asked == [("default", "resp_bg1")] * 2 + [("default", "other")]


def test_a_stream_request_is_checked_before_the_log_is_read(http: TestClient) -> None:
    for after in ("x", "-1", "1.5"):
        bad = http.get(f"/v1/responses/resp_0af9?stream=true&starting_after={after}")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
    unknown = http.get("/v1/responses/0af9?stream=true")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


# -- a resumed stream from the real Kafka -------------------------------------------

@dataclass
class Log:
    """Topics of the test's own, written as the gateway and postprocess write them."""

    settings: Settings
    producer: AIOKafkaProducer
    lookup: SharedLookup

    async def request(self, rid: str, generation: Generation, tenant: str = "default",
                      job_id: str = "") -> None:
        envelope = new_envelope(rid, reply_gateway="g", reply_partition=0, tenant=tenant,
                                job_id=job_id, deadline_ms=int(time.time() * 1000) + 30_000)
        await self.producer.send_and_wait(
            self.settings.kafka.topic("requests"),
            default_codec().encode("Request", Request(envelope=envelope, generation=generation)),
            key=rid.encode())

    async def reply(self, r: Reply) -> None:
        await self.producer.send_and_wait(
            self.settings.kafka.topic("replies"),
            REPLIES.encode(default_codec(), REPLIES.pack([r])), partition=0,
            headers=[request_ids_header([r["envelope"]["request_id"]])])


@pytest.fixture
async def log(services: None) -> AsyncIterator[Log]:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}", sse_keepalive_s=0.2)
    wanted = {settings.kafka.topic("requests"), settings.kafka.topic("replies")}
    await ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name in wanted])
    producer = make_producer(settings.kafka)
    await producer.start()
    lookup = SharedLookup(settings)
    try:
        yield Log(settings, producer, lookup)
    finally:
        await lookup.close()
        await producer.stop()
        await asyncio.to_thread(drop_topics, settings.kafka.bootstrap, settings.kafka.topic_prefix)


def resume_serving(log: Log, redis: aioredis.Redis, background: Any = None,
                   **update: Any) -> ResponsesServing:
    settings = log.settings.replace(**update)
    return responses_serving(settings, log.producer, redis, log.lookup, background)


async def test_a_response_resumes_from_the_log_then_live(log: Log,
                                                         redis: aioredis.Redis) -> None:
    rid = uuid.uuid4().hex
    req = body(instructions="Be brief.", max_output_tokens=8, temperature=0)
    await log.request(rid, generation_of(req))
    for r in (reply(0, "delta", "Par", rid=rid), reply(1, "delta", "is", rid=rid)):
        await log.reply(r)
    s = resume_serving(log, redis)
    me = Identity(tenant="default", key_id="")
    frames = await s.resume(me, f"resp_{rid}", 4)
    got: list[bytes] = []

    async def read() -> None:
        async for f in frames:
            got.append(f)

    reader = asyncio.create_task(read())
    for _ in range(50):  # the recorded events come before the final reply exists
        if len(got) >= 2:
            break
        await asyncio.sleep(0.1)
    assert len(parsed(got)) == 1  # event 5, "is"; then a keep-alive wait
    await log.reply(reply(2, "final", ".", "stop", USAGE, rid=rid))
    await asyncio.wait_for(reader, 30)
    events = parsed(got)
    assert [e.sequence_number for e in events] == list(range(5, 11))
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["is", "."]
    final = events[-1].response
    assert final.id == f"resp_{rid}" and final.output_text == "Paris."
    assert final.instructions == "Be brief." and final.max_output_tokens == 8
    assert final.completed_at is not None and abs(final.completed_at - time.time()) < 60
    whole = parsed([f async for f in await s.resume(me, f"resp_{rid}", -1)])
    assert [e.sequence_number for e in whole] == list(range(11))
    assert [e.model_dump() for e in whole[5:]] == [e.model_dump() for e in events]


async def test_a_response_of_another_tenant_or_a_background_one_is_not_streamed(
        log: Log, redis: aioredis.Redis) -> None:
    rid, job = uuid.uuid4().hex, f"resp_{uuid.uuid4().hex}"
    g = generation_of(body())
    await log.request(rid, g, tenant="owner")
    await log.request(job, {**g, "stream": False}, tenant="owner", job_id=job)
    s = resume_serving(log, redis, auth="keys")
    with pytest.raises(ResponseNotFound):
        await s.resume(Identity(tenant="stranger", key_id=""), f"resp_{rid}", -1)
    assert await s.resume(Identity(tenant="owner", key_id=""), f"resp_{rid}", -1)
    stored = Stored(response_object(job, 1700000000, body(background=True, stream=False),
                                    "in_progress"))
    with_background = resume_serving(log, redis, stored, auth="keys")
    with pytest.raises(InvalidRequest) as info:
        await with_background.resume(Identity(tenant="owner", key_id=""), job, -1)
    assert info.value.param == "stream" and "background" in info.value.message
    with pytest.raises(ResponseNotFound):
        await s.resume(Identity(tenant="owner", key_id=""), job, -1)
