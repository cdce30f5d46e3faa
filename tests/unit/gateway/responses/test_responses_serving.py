"""Serving a Responses request: its generation, its answer from the replies (whole
or as events), the names of its errors, and the route's background hook."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from conveyor.errors import RequestError
from conveyor.registry import Registry
from conveyor.settings import load_settings
from gateway import sse
from gateway.answer import Answer
from gateway.app import build_app
from gateway.auth.types import Identity
from gateway.replies import ReplyStream
from gateway.responses.objects import new_response_id, response_object
from gateway.responses.serving import ResponsesServing, generation_of, input_param
from schemas.codec import default_codec
from schemas.openai.responses import ResponsesRequest, parse_request
from schemas.records import ErrorInfo, Generation, Reply, Request, Usage
from tests.support.gateway_fakes import (
    RecordingProducer,
    Router,
    offline_services,
    responses_serving,
)
from tests.support.pipeline import TEST_MODELS
from topics.envelope import new_envelope

EVENT = TypeAdapter(ResponseStreamEvent)


def body(**fields: Any) -> ResponsesRequest:
    return parse_request(json.dumps({"model": "smollm2", "input": "Hi", **fields}).encode())


# -- the generation -------------------------------------------------------------

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
         "additionalProperties": False}


def test_text_format_asks_for_a_schema_as_chats_response_format_does() -> None:
    req = body(text={"format": {"type": "json_schema", "name": "point", "schema": POINT,
                                "strict": True}})
    fmt = generation_of(req)["response_format"]
    assert fmt is not None and json.loads(fmt["schema"]) == POINT
    assert (fmt["type"], fmt["name"], fmt["strict"]) == ("json_schema", "point", True)
    shown = response_object(new_response_id(), 1, req, "queued")
    assert shown["text"]["format"] == {"type": "json_schema", "name": "point", "schema": POINT,
                                       "strict": True, "description": None}
    Response.model_validate(shown)  # the openai client's shape
    assert generation_of(body(text={"format": {"type": "json_object"}})
                         )["response_format"] == {"type": "json_object", "name": "",
                                                  "schema": "", "strict": False}
    assert generation_of(body())["response_format"] is None


def test_a_text_format_schema_that_cannot_be_held_to_names_text_format_schema() -> None:
    req = body(text={"format": {"type": "json_schema", "name": "p",
                                "schema": {"type": "string", "pattern": "[a-z]+"}}})
    with pytest.raises(RequestError) as info:
        generation_of(req)
    assert info.value.status == 400 and info.value.param == "text.format.schema"


def test_the_generation_is_a_chat_with_the_instructions_first() -> None:
    g = generation_of(body(instructions="Be brief.", max_output_tokens=12, temperature=0.2,
                           top_p=0.9, stream=True, input=[
                               {"role": "developer", "content": "Dev."},
                               {"role": "user", "content": [{"type": "input_text",
                                                             "text": "Hello"}]}]))
    assert g["kind"] == "chat" and g["model"] == "smollm2" and g["prompt"] is None
    assert [(m["role"], m["content"]) for m in g["messages"]] == [
        ("system", "Be brief."), ("developer", "Dev."), ("user", "Hello")]
    assert g["sampling"]["max_tokens"] == 12 and g["sampling"]["temperature"] == 0.2
    assert g["sampling"]["top_p"] == 0.9 and g["sampling"]["stop"] == []
    assert g["stream"] is True
    default = generation_of(body())
    assert default["sampling"]["max_tokens"] is None
    assert default["sampling"]["temperature"] == 1.0 and default["stream"] is False
    event = Request(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                    generation=default)
    assert default_codec().decode(default_codec().encode("Request", event),
                                  "Request")["generation"] == default  # the pipeline carries it


def test_chat_params_are_named_as_the_request_named_them() -> None:
    told = body(instructions="Rules.", input=[{"role": "user", "content": "a"},
                                              {"role": "user", "content": "b"}])
    assert input_param("messages[0].content", told) == "instructions"
    assert input_param("messages[2].content", told) == "input[1].content"
    assert input_param("messages[1]", told) == "input[0]"
    assert input_param("messages[0].content", body()) == "input"
    assert input_param("messages", told) == "input"
    assert input_param("max_tokens", told) == "max_output_tokens"
    assert input_param("model", told) == "model" and input_param(None, told) is None


# -- answers from replies -----------------------------------------------------

def reply(index: int, kind: str, text: str = "", finish: str | None = None,
          usage: Usage | None = None, error: ErrorInfo | None = None) -> Reply:
    return Reply(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                 index=index, kind=kind, text=text, chunk="",  # type: ignore[typeddict-item]
                 finish_reason=finish, usage=usage, error=error)


def setup(deadline_s: float = 5.0, keepalive: float = 0.05
          ) -> tuple[ResponsesServing, Answer, RecordingProducer]:
    producer = RecordingProducer()
    settings = load_settings(topic_prefix="rs", sse_keepalive_s=keepalive)
    serving = responses_serving(settings, producer)
    answer = Answer(ReplyStream("r1"), time.monotonic() + deadline_s,
                    Router(), serving.submitter.cancels)  # type: ignore[arg-type]
    return serving, answer, producer


async def still_here() -> bool:
    return False


def parsed(frames: list[bytes]) -> list[Any]:
    events = []
    for raw in frames:
        if raw.startswith(b":"):
            continue
        name, data, _ = raw.split(b"\n", 2)
        event = EVENT.validate_python(json.loads(data.removeprefix(b"data: ")))
        assert name == b"event: " + event.type.encode()
        events.append(event)
    return events


async def test_collected_replies_are_one_response_object() -> None:
    serving, answer, _ = setup()
    req = body(max_output_tokens=2)
    g = generation_of(req)
    answer.stream.put(reply(0, "delta", "Once"))
    answer.stream.put(reply(1, "final", " upon", "length",
                            Usage(prompt_tokens=9, completion_tokens=2)))
    obj = await serving.collect(g, answer, req, still_here)
    r = Response.model_validate(obj)
    assert r.id == "resp_r1" and r.output_text == "Once upon" and r.status == "incomplete"
    assert r.usage is not None and r.usage.total_tokens == 11
    assert r.created_at == g["created"]


async def test_an_error_before_the_first_token_names_the_responses_param() -> None:
    serving, answer, _ = setup()
    req = body(instructions="Rules.", input=[{"role": "user", "content": "a"}])
    error = ErrorInfo(status=400, type="invalid_request_error", code=None,
                      param="messages[1].content", message="Invalid content.")
    answer.stream.put(reply(0, "error", error=error))
    with pytest.raises(RequestError) as info:
        await serving.first(answer, req, still_here)
    assert info.value.status == 400 and info.value.param == "input[0].content"


async def test_streamed_replies_are_the_responses_events() -> None:
    serving, answer, _ = setup()
    req = body(stream=True)
    g = generation_of(req)

    async def later() -> None:
        await asyncio.sleep(0.2)  # a keep-alive comment goes out meanwhile
        answer.stream.put(reply(1, "final", "is.", "stop",
                                Usage(prompt_tokens=4, completion_tokens=2)))

    answer.stream.put(reply(0, "delta", "Par"))
    first = await serving.first(answer, req, still_here)
    assert first is not None
    feeder = asyncio.create_task(later())
    frames = [f async for f in serving.stream(g, answer, req, first)]
    await feeder
    assert b": keep-alive\n" in frames
    events = parsed(frames)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["Par", "is."]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Paris." and events[-1].response.id == "resp_r1"
    # the ending event is the last frame: sent with the end of the body (gateway/sse.py)
    assert [isinstance(f, sse.Last) for f in frames] == [False] * (len(frames) - 1) + [True]


async def test_a_failure_mid_stream_is_response_failed_and_cancels() -> None:
    serving, answer, producer = setup(deadline_s=0.2, keepalive=5.0)
    req = body(stream=True)
    frames = [f async for f in serving.stream(generation_of(req), answer, req,
                                             reply(0, "delta", "Par"))]
    events = parsed(frames)
    assert events[-1].type == "response.failed" and isinstance(frames[-1], sse.Last)
    failed = events[-1].response
    assert failed.status == "failed" and failed.output_text == "Par"
    assert "deadline" in failed.error.message
    await asyncio.sleep(0.05)
    assert producer.cancelled() == ["r1"]  # the generation is cancelled


async def test_a_client_that_leaves_mid_stream_cancels_the_generation() -> None:
    """At once when streams are not resumable (after the grace otherwise: see
    tests/kafka/gateway/test_responses_resume.py)."""
    serving, answer, producer = setup()
    serving.settings = serving.settings.replace(resumable_streams=False)
    req = body(stream=True)
    frames = serving.stream(generation_of(req), answer, req, reply(0, "delta", "Par"))
    assert (await frames.__anext__()).startswith(b"event: response.created\n")
    await frames.aclose()
    await asyncio.sleep(0.05)
    assert producer.cancelled() == ["r1"]


# -- the route ------------------------------------------------------------------

@dataclass
class TakenInBackground:
    """What a background machinery receives; it answers with the queued response."""

    taken: list[tuple[Identity, ResponsesRequest, Generation]] = field(default_factory=list)

    async def create(self, identity: Identity, body: ResponsesRequest,
                     generation: Generation) -> dict[str, Any]:
        self.taken.append((identity, body, generation))
        return response_object(new_response_id(), generation["created"], body, "queued")


@pytest.fixture(scope="module")
def http() -> TestClient:
    """The gateway's own application, without its pipeline (no lifespan runs)."""
    settings, registry = load_settings(topic_prefix="rs"), Registry.load(TEST_MODELS)
    app = build_app(settings, registry)
    app.state.services = offline_services(settings, registry)
    return TestClient(app)


def test_background_goes_to_the_hook_or_is_refused(http: TestClient) -> None:
    request = {"model": "smollm2", "input": "Hi", "background": True,
               "instructions": "Be brief."}
    refused = http.post("/v1/responses", json=request)
    assert refused.status_code == 400
    assert refused.json()["error"] == {"message": "background responses are not enabled",
                                       "type": "invalid_request_error",
                                       "param": "background", "code": None}
    hook = TakenInBackground()
    responses = http.app.state.services.responses  # type: ignore[attr-defined]
    responses.background = hook
    try:
        answered = http.post("/v1/responses", json=request)
    finally:
        responses.background = None
    assert answered.status_code == 200
    r = Response.model_validate(answered.json())
    assert r.status == "queued" and r.background is True and r.instructions == "Be brief."
    [(identity, taken, generation)] = hook.taken
    assert identity.tenant == "default" and taken.background
    assert [m["role"] for m in generation["messages"]] == ["system", "user"]


def test_refusals_over_http_name_the_param(http: TestClient) -> None:
    r = http.post("/v1/responses", json={"model": "smollm2", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": 5}]}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input[0].content[0].text"
    bad = http.post("/v1/responses", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["param"] is None


def test_the_openapi_document_describes_the_route(http: TestClient) -> None:
    doc = http.get("/openapi.json").json()
    operation = doc["paths"]["/v1/responses"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert "$ref" not in json.dumps(schema) and "input" in schema["properties"]
    assert schema["required"] == ["model", "input"]
    ok = operation["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/ResponseObject"}
    assert "text/event-stream" in ok and "400" in operation["responses"]
