"""Images end to end, with the unmodified ``openai`` client: through the real
gateway, Kafka, Redis, preprocess, route, schedule and an infer worker whose
``openai`` engine forwards to a vision upstream (a small real HTTP server
here) that checks the bytes it receives: it answers with each image's media
type and sha256, and keeps the bytes for the test. A text model refuses an
image part with a 400 naming it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from schemas.codec import default_codec
from tests.support.asgi import chat_events, serving
from tests.support.images import data_url, image_bytes
from tests.support.pipeline import TEST_MODELS, Pipeline, client
from topics.lookup import SharedLookup

VISION = """
# a model that reads images, behind the vision upstream of this test
[models."eyes"]
pool = "eyes"
context_length = 8192
tokenizer = "estimate"
upstream_model = "fake-vision"
vision = true
"""


@dataclass
class VisionUpstream:
    """What the upstream received: each image part's bytes, in order."""

    base_url: str = ""
    images: list[tuple[str, bytes]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)


def sent_images(body: dict[str, Any]) -> list[tuple[str, bytes]]:
    """The images of a chat request's messages as an upstream receives them:
    (media type, bytes) in order, each a base64 data URL."""
    images = []
    for message in body["messages"]:
        for part in message["content"] if isinstance(message["content"], list) else ():
            if part["type"] == "image_url":
                head, _, payload = part["image_url"]["url"].partition(",")
                assert head.startswith("data:") and head.endswith(";base64")
                images.append((head[5:-7], base64.b64decode(payload, validate=True)))
    return images


def _app(upstream: VisionUpstream) -> Starlette:
    async def chat(request: Request) -> Response:
        body = await request.json()
        upstream.bodies.append(body)
        images = sent_images(body)
        upstream.images.extend(images)
        seen = [f"{kind} {hashlib.sha256(data).hexdigest()}" for kind, data in images]
        usage = {"prompt_tokens": 9, "completion_tokens": len(seen) or 1}
        return StreamingResponse(chat_events([f"{text}\n" for text in seen or ["no image"]],
                                             usage=usage), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def upstream() -> Iterator[VisionUpstream]:
    made = VisionUpstream()
    with serving(_app(made), lifespan="off") as port:
        made.base_url = f"http://127.0.0.1:{port}"
        yield made


@pytest.fixture(scope="module")
def p(services: None, upstream: VisionUpstream,
      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    logs = tmp_path_factory.mktemp("images")
    models = logs / "models.toml"
    models.write_text(TEST_MODELS.read_text() + VISION)
    made = Pipeline(logs, models=models, CONVEYOR_FILES_DIR=str(logs / "files"))
    try:
        made.cli("topics")
        made.spawn("layers", "layer")
        made.start_worker("w0")
        made.spawn("eyes", "infer", "--pool", "eyes", "--engine", "openai", "--worker-id",
                   "eyes", "--upstream", upstream.base_url)
        made.spawn("gateway", "gateway")
        made.wait_ready()
        made.wait_workers(1, pool="eyes")
        yield made
    finally:
        made.close()


def looking(*urls: str, text: str = "What is in these pictures?") -> list[Any]:
    return [{"role": "system", "content": "Describe."},
            {"role": "user", "content": [{"type": "text", "text": text}, *[
                {"type": "image_url", "image_url": {"url": url}} for url in urls]]}]


def test_images_reach_the_vision_upstream_byte_for_byte(p: Pipeline,
                                                        upstream: VisionUpstream) -> None:
    png = image_bytes("PNG", (64, 48), (10, 120, 200))
    jpeg = image_bytes("JPEG", (32, 32), (250, 250, 0))
    upstream.images.clear()
    answer = client(p).chat.completions.create(
        model="eyes", messages=looking(data_url(png), data_url(jpeg, "image/jpeg"), data_url(png)))
    assert answer.choices[0].message.content == "".join(
        f"{kind} {hashlib.sha256(data).hexdigest()}\n"
        for kind, data in (("image/png", png), ("image/jpeg", jpeg), ("image/png", png)))
    assert upstream.images == [("image/png", png), ("image/jpeg", jpeg), ("image/png", png)]
    sent = upstream.bodies[-1]
    assert sent["model"] == "fake-vision"
    assert sent["messages"][1]["content"][0] == {"type": "text",
                                                 "text": "What is in these pictures?"}
    # the prompt counts the images (85 + 170 a tile each) and the texts
    assert answer.usage is not None and answer.usage.prompt_tokens > 3 * 255

    # streamed, the same bytes again; the png is one file of the tenant's
    chunks = client(p).chat.completions.create(model="eyes", messages=looking(data_url(png)),
                                               stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == f"image/png {hashlib.sha256(png).hexdigest()}\n"
    assert upstream.images[-1] == ("image/png", png)
    stored = [f for f in Path(p.env["CONVEYOR_FILES_DIR"]).rglob("file-*")
              if not f.name.endswith(".json")]
    assert sorted(f.read_bytes() for f in stored) == sorted([png, jpeg])


def test_no_event_holds_an_image(p: Pipeline) -> None:
    png = image_bytes("PNG", (200, 200), (1, 2, 3))
    since_ms = int(time.time() * 1000) - 1000
    raw = client(p).chat.completions.with_raw_response.create(
        model="eyes", messages=looking(data_url(png)), max_tokens=8)
    rid = raw.headers["x-request-id"]

    async def values() -> list[bytes]:
        lookup = SharedLookup(p.settings)
        try:
            return [record.value or b"" for name in ("requests", "prepared", "routed")
                    for record in await lookup.records(p.settings.kafka.topic(name), rid,
                                                       since_ms)]
        finally:
            await lookup.close()

    found = asyncio.run(values())
    assert len(found) >= 3 and all(png not in v and len(v) < 4096 for v in found)
    task = default_codec().decode(found[-1], "Task")
    (ref,) = task["generation"]["messages"][1]["images"]
    assert ref["sha256"] == hashlib.sha256(png).hexdigest() and ref["bytes"] == len(png)
    # the request's journey, content and all, shows the reference, not the image
    shown = p.cli("inspect", rid, "--show-content", "--json")
    assert ref["sha256"] in shown and base64.b64encode(png).decode()[:64] not in shown
    assert len(shown) < 64 * 1024
    # replayed through preprocess and route, it comes out as it did
    replayed = json.loads(p.cli("replay", rid, "--through", "preprocess,route", "--json"))
    assert replayed["same"], replayed
    assert {x["layer"] for x in replayed["layers"]} == {"preprocess", "route"}


def test_an_image_for_the_default_text_model_is_a_400_naming_the_part(p: Pipeline) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(p).chat.completions.create(model="smollm2",
                                          messages=looking(data_url(image_bytes())))
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "messages[1].content[1]" and error["type"] == "invalid_request_error"
    assert "does not read images" in error["message"]


def test_bad_images_are_400s_in_openai_s_envelope(p: Pipeline) -> None:
    for url, param in ((data_url(b"no image here"), "messages[1].content[1]"),
                       ("https://example.com/cat.png", "messages[1].content[1].image_url.url"),
                       ("data:image/png;base64,!!", "messages[1].content[1].image_url.url")):
        with pytest.raises(openai.BadRequestError) as caught:
            client(p).chat.completions.create(model="eyes", messages=looking(url))
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param, error


def test_the_responses_api_sends_images_byte_for_byte(p: Pipeline,
                                                      upstream: VisionUpstream) -> None:
    gif = image_bytes("GIF", (16, 16), (0, 200, 0))
    answer = client(p).responses.create(model="eyes", instructions="Describe.", input=[
        {"role": "user", "content": [
            {"type": "input_text", "text": "And this one?"},
            {"type": "input_image", "image_url": data_url(gif, "image/gif"), "detail": "low"}]}])
    assert answer.output_text == f"image/gif {hashlib.sha256(gif).hexdigest()}\n"
    assert upstream.images[-1] == ("image/gif", gif)
    part = upstream.bodies[-1]["messages"][1]["content"][1]
    assert part["image_url"]["detail"] == "low"


def test_a_response_that_continues_another_sends_its_images_again(
        p: Pipeline, upstream: VisionUpstream) -> None:
    png = image_bytes("PNG", (8, 8), (9, 9, 9))
    first = client(p).responses.create(model="eyes", store=True, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(png)}]}])
    upstream.images.clear()
    second = client(p).responses.create(model="eyes", previous_response_id=first.id,
                                        input="And what colour is it?")
    assert second.output_text == f"image/png {hashlib.sha256(png).hexdigest()}\n"
    assert upstream.images == [("image/png", png)]


def test_a_background_response_sends_its_image_byte_for_byte(
        p: Pipeline, upstream: VisionUpstream) -> None:
    jpeg = image_bytes("JPEG", (24, 24), (200, 10, 10))
    c = client(p)
    created = c.responses.create(model="eyes", background=True, input=[
        {"role": "user", "content": [{"type": "input_image",
                                      "image_url": data_url(jpeg, "image/jpeg")}]}])
    deadline = time.monotonic() + 60
    got = c.responses.retrieve(created.id)
    while got.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        got = c.responses.retrieve(created.id)
    assert got.status == "completed", got
    assert got.output_text == f"image/jpeg {hashlib.sha256(jpeg).hexdigest()}\n"
    assert upstream.images[-1] == ("image/jpeg", jpeg)
