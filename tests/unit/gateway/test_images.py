"""The image parts of chat requests at the gateway (gateway/images.py): read,
checked and stored once before submission, or refused in OpenAI's envelope
naming the part, nothing stored. Through the gateway's own application (httpx's
ASGI transport, no Kafka: every case here is refused before a request is
submitted) and the intake itself for what is stored."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from conveyor.errors import InvalidRequest, ModelNotFound
from conveyor.files.images import image_file_id
from conveyor.files.local import LocalFileStore
from conveyor.registry import Registry
from conveyor.settings import Settings, load_settings
from gateway.app import build_app
from gateway.auth.types import Identity
from gateway.images import ImageIntake, _public
from schemas.codec import default_codec
from schemas.openai.generations import chat_generation
from schemas.openai.requests import ChatCompletionRequest
from schemas.records import ImageRef, Request
from tests.support.gateway_fakes import image_intake, offline_services
from tests.support.images import data_url, image_bytes
from topics.envelope import new_envelope

ACME = Identity(tenant="acme", key_id="")

MODELS = """
[models."smollm2"]
pool = "cpu"
context_length = 2048

[models."eyes"]
pool = "eyes"
context_length = 8192
vision = true
"""


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load_settings(files_dir=tmp_path / "files", images_max_count=2,
                         images_max_bytes=4096, images_max_pixels=10_000,
                         images_allowed_hosts="127.0.0.1")


@pytest.fixture
def registry() -> Registry:
    return Registry.parse(MODELS, "test")


@pytest.fixture
async def client(settings: Settings, registry: Registry) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(settings, registry)
    app.state.services = offline_services(settings, registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://conveyor") as http:
        yield http


def body(*parts: dict[str, Any], model: str = "eyes") -> dict[str, Any]:
    return {"model": model, "messages": [
        {"role": "system", "content": "Look."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]}


def image(url: str, **fields: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **fields}}


async def refused(client: httpx.AsyncClient, sent: dict[str, Any],
                  status: int = 400) -> dict[str, Any]:
    r = await client.post("/v1/chat/completions", json=sent)
    assert r.status_code == status, r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def stored(settings: Settings) -> list[Path]:
    return sorted(p for p in Path(settings.jobs.files_dir).rglob("file-*"))


async def test_an_image_for_a_text_model_is_a_400_naming_the_part(
        client: httpx.AsyncClient, settings: Settings) -> None:
    error = await refused(client, body(image(data_url(image_bytes())), model="smollm2"))
    assert error["param"] == "messages[1].content[1]"
    assert error["type"] == "invalid_request_error"
    assert "does not read images" in error["message"]
    assert stored(settings) == []


async def test_an_image_for_a_model_the_caller_may_not_use_is_a_404_as_admission_says(
        client: httpx.AsyncClient, settings: Settings, registry: Registry) -> None:
    error = await refused(client, body(image(data_url(image_bytes())), model="nope"), 404)
    assert error["param"] == "model" and "does not exist" in error["message"]
    intake = image_intake(settings, registry)
    parsed = ChatCompletionRequest.model_validate(body(image(data_url(image_bytes()))))
    with pytest.raises(ModelNotFound):  # a key for the text model alone
        await intake.refs(parsed, Identity("acme", "k1", models=frozenset({"smollm2"})))
    assert stored(settings) == []
    assert await intake.refs(parsed, Identity("acme", "k2", models=frozenset({"eyes"})))


@pytest.mark.parametrize(("part", "param", "words"), [
    (image("data:image/png;base64,@@@"), "messages[1].content[1].image_url.url",
     "not valid base64"),
    (image("data:image/png,raw"), "messages[1].content[1].image_url.url", "base64 data URL"),
    (image(data_url(b"not an image at all")), "messages[1].content[1]", "not an image"),
    (image(data_url(image_bytes("PNG"), "image/jpeg")), "messages[1].content[1]",
     "says image/jpeg"),
    (image(data_url(image_bytes("PNG", (101, 100)))), "messages[1].content[1]",
     "(101 x 100)"),
    (image(data_url(b"\x00" * 5000)), "messages[1].content[1]", "larger than 4096 bytes"),
    (image("https://images.example.com/cat.png"), "messages[1].content[1].image_url.url",
     "does not fetch images from images.example.com"),
    (image("ftp://127.0.0.1/cat.png"), "messages[1].content[1].image_url.url",
     "expected a data URL"),
    (image("http://[::1/cat.png"), "messages[1].content[1].image_url.url", "not a URL"),
    (image(data_url(image_bytes()), detail="ultra"), "messages[1].content[1].image_url.detail",
     "'auto', 'low' or 'high'"),
    ({"type": "input_audio", "input_audio": {}}, "messages[1].content[1]",
     "'text' or 'image_url'"),
])
async def test_a_bad_image_part_is_a_400_naming_it(
        client: httpx.AsyncClient, settings: Settings, part: dict[str, Any], param: str,
        words: str) -> None:
    error = await refused(client, body(part))
    assert error["param"] == param and words in error["message"], error
    assert stored(settings) == []


async def test_nothing_is_stored_when_a_later_image_is_refused(
        client: httpx.AsyncClient, settings: Settings) -> None:
    error = await refused(client, body(image(data_url(image_bytes())),
                                       image(data_url(b"not an image at all"))))
    assert error["param"] == "messages[1].content[2]" and "not an image" in error["message"]
    assert stored(settings) == []


async def test_images_only_come_from_the_user(client: httpx.AsyncClient) -> None:
    part = image(data_url(image_bytes()))
    error = await refused(client, {"model": "eyes", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Look."}, part]}]})
    assert error["param"] == "messages[0]" and "role 'user'" in error["message"]
    r = await client.post("/v1/responses", json={"model": "eyes", "input": [
        {"role": "assistant", "content": [{"type": "input_image",
                                           "image_url": data_url(image_bytes())}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]", r.text


async def test_more_images_than_allowed_are_refused_naming_the_first_too_many(
        client: httpx.AsyncClient) -> None:
    url = data_url(image_bytes())
    error = await refused(client, body(image(url), image(url), image(url)))
    assert error["param"] == "messages[1].content[3]" and "at most 2 images" in error["message"]


async def test_a_chat_body_may_be_larger_than_other_routes_take(
        client: httpx.AsyncClient, settings: Settings) -> None:
    big = "x" * (settings.gateway.max_body_bytes + 10)
    r = await client.post("/v1/completions", json={"model": "smollm2", "prompt": big})
    assert r.status_code == 413
    # chat completions read it (and refuse the missing images' model here)
    error = await refused(client, {**body(image(data_url(image_bytes())), model="smollm2"),
                                   "user": big})
    assert "does not read images" in error["message"]
    r = await client.post("/v1/responses", json={**responses_body(
        {"type": "input_image", "image_url": data_url(image_bytes())}, model="smollm2"),
        "user": big})
    assert r.status_code == 400 and "does not read images" in r.text


async def test_images_are_stored_once_and_carried_by_reference(
        settings: Settings, registry: Registry) -> None:
    files = LocalFileStore(settings.jobs)
    intake = image_intake(settings.replace(images_max_count=3), registry)
    png, gif = image_bytes("PNG", (4, 3)), image_bytes("GIF")
    parsed = ChatCompletionRequest.model_validate(
        body(image(data_url(png), detail="low"), {"type": "text", "text": " and "},
             image(data_url(gif, "image/gif")), image(data_url(png))))
    refs = await intake.refs(parsed, ACME)
    generation = chat_generation(parsed, refs)
    message = generation["messages"][1]
    assert message["content"] == "What is this? and "
    images = message["images"] or []
    assert [(r["part"], r["offset"], r["media_type"], r["detail"]) for r in images] == [
        ("messages[1].content[1]", 13, "image/png", "low"),
        ("messages[1].content[3]", 18, "image/gif", "auto"),
        ("messages[1].content[4]", 18, "image/png", "auto")]
    digest = hashlib.sha256(png).hexdigest()
    assert images[0] == {**images[2], "part": "messages[1].content[1]", "offset": 13,
                         "detail": "low"}
    assert (images[0]["file_id"], images[0]["sha256"], images[0]["bytes"],
            images[0]["width"], images[0]["height"]) == (
        image_file_id(digest), digest, len(png), 4, 3)
    assert await files.read("acme", images[0]["file_id"]) == png
    assert len((await files.list("acme")).data) == 2  # the png once
    # the event holds the references, not the images
    event = default_codec().encode("Request", Request(
        envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
        generation=generation))
    assert png not in event and len(event) < 2048


@pytest.fixture
async def server() -> AsyncIterator[int]:
    """An image server on loopback: its port."""
    png = image_bytes()
    app = web.Application()
    pair: list[str] = []
    both = asyncio.Event()

    async def serve(request: web.Request) -> web.Response:
        if request.path == "/cat.png":
            return web.Response(body=png, content_type="image/png")
        if request.path == "/big.png":
            return web.Response(body=b"\x00" * 5000)
        if request.path == "/zipped.png":
            return web.Response(body=gzip.compress(png), content_type="image/png",
                                headers={"Content-Encoding": "gzip"})
        if request.path.startswith("/pair"):  # answers once both of a pair are asked
            pair.append(request.path)
            if len(pair) == 2:
                both.set()
            await asyncio.wait_for(both.wait(), 5)
            return web.Response(body=png, content_type="image/png")
        if request.path == "/slow.png":
            await asyncio.sleep(1)
        raise web.HTTPFound("https://elsewhere.example.com/cat.png")

    app.router.add_get("/{name}", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


def intake_of(settings: Settings, registry: Registry, **changes: Any) -> ImageIntake:
    return image_intake(settings.replace(**changes), registry)


async def fetched(intake: ImageIntake, url: str) -> ImageRef:
    parsed = ChatCompletionRequest.model_validate(body(image(url)))
    (ref,) = (await intake.refs(parsed, ACME)).values()
    return ref


async def test_a_remote_image_is_fetched_only_from_a_listed_host(
        settings: Settings, registry: Registry, server: int) -> None:
    intake = intake_of(settings, registry, images_allowed_hosts=f"127.0.0.1:{server}",
                       images_allow_private_addresses=True)
    ref = await fetched(intake, f"http://127.0.0.1:{server}/cat.png")
    assert ref["sha256"] == hashlib.sha256(image_bytes()).hexdigest()
    for name, words in (("big.png", "larger than 4096"), ("moved.png", "HTTP 302")):
        with pytest.raises(InvalidRequest, match=words):
            await fetched(intake, f"http://127.0.0.1:{server}/{name}")


async def test_a_request_s_images_are_fetched_at_once_within_its_timeout(
        settings: Settings, registry: Registry, server: int) -> None:
    intake = intake_of(settings, registry, images_allowed_hosts=f"127.0.0.1:{server}",
                       images_allow_private_addresses=True, images_fetch_timeout_s=2.0)
    parsed = ChatCompletionRequest.model_validate(body(
        image(f"http://127.0.0.1:{server}/pair-1.png"),
        image(f"http://127.0.0.1:{server}/pair-2.png")))
    assert len(await intake.refs(parsed, ACME)) == 2  # one after the other: a timeout
    intake = intake_of(settings, registry, images_allowed_hosts=f"127.0.0.1:{server}",
                       images_allow_private_addresses=True, images_fetch_timeout_s=0.3)
    parsed = ChatCompletionRequest.model_validate(body(
        image(data_url(image_bytes(color=(1, 2, 3)))),
        image(f"http://127.0.0.1:{server}/slow.png")))
    kept = stored(settings)
    with pytest.raises(InvalidRequest, match="could not be fetched") as told:
        await intake.refs(parsed, ACME)
    assert told.value.param == "messages[1].content[2].image_url.url"
    assert stored(settings) == kept


async def test_a_listed_host_is_fetched_only_at_its_default_port_unless_one_is_listed(
        settings: Settings, registry: Registry, server: int) -> None:
    intake = intake_of(settings, registry, images_allowed_hosts="127.0.0.1,localhost:1",
                       images_allow_private_addresses=True)
    for url in (f"http://127.0.0.1:{server}/cat.png", f"http://localhost:{server}/cat.png"):
        with pytest.raises(InvalidRequest, match=f"does not fetch images from .*:{server};"):
            await fetched(intake, url)
    intake = intake_of(settings, registry, images_allowed_hosts=f"localhost:{server}",
                       images_allow_private_addresses=True)
    assert (await fetched(intake, f"http://localhost:{server}/cat.png"))["width"] == 3


async def test_a_listed_host_at_a_private_address_is_not_fetched_unless_allowed(
        settings: Settings, registry: Registry, server: int) -> None:
    listed = f"127.0.0.1:{server},localhost:{server},[::1]:{server}"
    intake = intake_of(settings, registry, images_allowed_hosts=listed)
    # an address in the URL, or one its name resolves to (checked where it connects)
    for host in ("127.0.0.1", "localhost", "[::1]"):
        with pytest.raises(InvalidRequest, match="not at a public address") as told:
            await fetched(intake, f"http://{host}:{server}/cat.png")
        assert told.value.param == "messages[1].content[1].image_url.url"
    assert stored(settings) == []


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True), ("127.0.0.1", False), ("::1", False),
    ("10.1.2.3", False), ("192.168.0.1", False), ("169.254.169.254", False),
    ("100.64.0.1", False), ("0.0.0.0", False), ("::ffff:127.0.0.1", False),
    ("::ffff:169.254.169.254", False), ("fe80::1%eth0", False), ("224.0.0.1", False),
    ("not-an-address", False)])
def test_only_global_addresses_are_public(address: str, public: bool) -> None:
    assert _public(address) is public


async def test_an_encoded_image_is_refused_for_its_size_is_told_unencoded(
        settings: Settings, registry: Registry, server: int) -> None:
    intake = intake_of(settings, registry, images_allowed_hosts=f"127.0.0.1:{server}",
                       images_allow_private_addresses=True)
    with pytest.raises(InvalidRequest, match=r"came encoded \(gzip\)"):
        await fetched(intake, f"http://127.0.0.1:{server}/zipped.png")


def responses_body(*parts: dict[str, Any], model: str = "eyes") -> dict[str, Any]:
    return {"model": model, "instructions": "Look.", "input": [
        {"role": "user", "content": "Hello."},
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, *parts]}]}


async def test_the_responses_api_refuses_images_as_chat_does_naming_the_input_part(
        client: httpx.AsyncClient, settings: Settings) -> None:
    url = data_url(image_bytes())
    for sent, status, param, words in (
            (responses_body({"type": "input_image", "image_url": url}, model="smollm2"), 400,
             "input[1].content[1]", "does not read images"),
            (responses_body({"type": "input_image", "file_id": "file-abc"}), 400,
             "input[1].content[1]", "not a file_id"),
            (responses_body({"type": "input_image", "image_url": data_url(b"nope")}), 400,
             "input[1].content[1]", "not an image"),
            (responses_body({"type": "input_image", "image_url": "https://example.com/x.png"}),
             400, "input[1].content[1].image_url", "does not fetch images")):
        r = await client.post("/v1/responses", json=sent)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    assert stored(settings) == []


async def test_a_response_s_images_are_stored_and_listed_among_its_input_items(
        settings: Settings, registry: Registry) -> None:
    from gateway.responses.objects import input_items
    from gateway.responses.serving import generation_of
    from schemas.openai.responses import parse_request

    intake = image_intake(settings, registry)
    png = image_bytes()
    body = parse_request(json.dumps(responses_body(
        {"type": "input_image", "image_url": data_url(png), "detail": "high"},
        {"type": "input_text", "text": " Be brief."})).encode())
    refs = await intake.input_refs(body, ACME)
    generation = generation_of(body, refs)
    system, hello, seeing = generation["messages"]
    assert (system["content"], hello.get("images")) == ("Look.", None)
    (ref,) = seeing["images"] or []
    assert (ref["part"], ref["offset"], ref["detail"]) == ("input[1].content[1]", 13, "high")
    assert ref["sha256"] == hashlib.sha256(png).hexdigest()
    (_, listed) = input_items("r1", [hello, seeing])
    assert listed["content"] == [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "file_id": ref["file_id"], "image_url": None, "detail": "high"},
        {"type": "input_text", "text": " Be brief."}]
    with pytest.raises(Exception, match="POST /v1/responses only"):
        generation_of(body)  # the WebSocket's mode: no images stored, none taken


async def test_a_gateway_without_an_image_store_refuses_images_as_its_own(
        settings: Settings, registry: Registry) -> None:
    from gateway.responses.serving import ResponsesServing

    app = build_app(settings, registry)
    services = offline_services(settings, registry)
    app.state.services = dataclasses.replace(services, responses=ResponsesServing(
        settings, services.submitter, services.stored, None, None))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://conveyor") as http:
        r = await http.post("/v1/responses", json=responses_body(
            {"type": "input_image", "image_url": data_url(image_bytes())}))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input[1].content[1]", r.text
    assert error["message"].endswith("this gateway takes no image parts."), error
