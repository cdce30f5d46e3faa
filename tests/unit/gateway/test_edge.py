"""The gateway's edge under a real HTTP server (uvicorn, httptools, as ``conveyor
gateway`` runs it): the body limit, the error envelope, and kept-alive
connections that survive any failure. The routes are stand-ins that fail on
purpose; the middleware and the handlers are the gateway's own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from conveyor.errors import InvalidRequest, RedisUnavailable, TransientBrokerError
from conveyor.registry import Registry
from conveyor.settings import load_settings
from gateway.app import _body_limit
from gateway.errors import install_error_handlers
from gateway.limits import BodyLimit
from schemas.openai.requests import ChatCompletionRequest
from tests.support.asgi import serving

LIMIT = 64 * 1024


def edge_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodyLimit, max_bytes=LIMIT)
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(body: ChatCompletionRequest) -> dict[str, Any]:
        return {"model": body.model}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/kafka-late")
    async def kafka_late() -> None:
        raise TransientBrokerError("conveyor.replies: no answer within 5 s")

    @app.get("/redis-down")
    async def redis_down() -> None:
        raise RedisUnavailable("redis unreachable")

    @app.get("/surrogate")
    async def surrogate() -> None:
        raise InvalidRequest("bad value \ud800 here", param="x\udc00")

    return app


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(edge_app()) as port:
        yield f"http://127.0.0.1:{port}"


def local_port(r: httpx.Response) -> int:
    stream = r.extensions["network_stream"]
    return int(stream.get_extra_info("client_addr")[1])


def one_connection(base_url: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, timeout=30,
                        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))


GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def assert_envelope(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize("bad", [
    ("GET", "/boom", None),
    ("GET", "/surrogate", None),
    ("POST", "/echo", b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("POST", "/echo", b'{"model": "m", "messages": ['),
    ("POST", "/echo", b'{"model": "m", "stream": "yes", "messages": []}'),
    ("GET", "/nowhere", None),
])
def test_a_failed_request_keeps_the_connection(base_url: str,
                                               bad: tuple[str, str, bytes | None]) -> None:
    method, path, body = bad
    with one_connection(base_url) as client:
        before = client.post("/echo", json=GOOD)
        assert before.status_code == 200
        r = client.request(method, path, content=body,
                           headers={"content-type": "application/json"})
        assert_envelope(r, r.status_code)
        assert r.status_code < 600
        after = client.post("/echo", json=GOOD)
        assert after.json() == {"model": "m"}
        assert local_port(before) == local_port(r) == local_port(after)


def test_an_unexpected_error_is_a_500_envelope(base_url: str) -> None:
    err = assert_envelope(httpx.get(f"{base_url}/boom"), 500)
    assert err["type"] == "server_error" and "a bug" not in err["message"]


@pytest.mark.parametrize("path", ["/kafka-late", "/redis-down"])
def test_kafka_or_redis_failing_under_a_route_is_a_503_envelope(base_url: str,
                                                                path: str) -> None:
    """Conveyor's own broker errors (a lookup's timeout, Redis's translated
    outage) are the pipeline being unavailable, as aiokafka's and redis's are."""
    err = assert_envelope(httpx.get(f"{base_url}{path}"), 503)
    assert err["code"] == "pipeline_unavailable"


def test_an_error_that_echoes_a_lone_surrogate_still_encodes(base_url: str) -> None:
    r = httpx.get(f"{base_url}/surrogate")
    err = assert_envelope(r, 400)
    assert err["message"] == "bad value \ud800 here"  # JSON's \ud800 escape, valid ASCII
    assert r.content.isascii()


def test_a_lone_surrogate_is_a_400_naming_the_field(base_url: str) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800"}]}'
    err = assert_envelope(httpx.post(f"{base_url}/echo", content=body,
                                     headers={"content-type": "application/json"}), 400)
    assert err["param"] == "messages[0].content"
    assert "surrogate" in err["message"]


def test_the_param_of_a_content_part(base_url: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": 5}]}]}
    err = assert_envelope(httpx.post(f"{base_url}/echo", json=body), 400)
    assert err["param"] == "messages[0].content[1].text"


def test_a_declared_body_over_the_limit_is_413(base_url: str) -> None:
    big = b"x" * (LIMIT + 1)
    err = assert_envelope(httpx.post(f"{base_url}/echo", content=big,
                                     headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"


def test_a_chunked_body_over_the_limit_is_413(base_url: str) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(LIMIT // 1024 + 2):
            yield b"x" * 1024

    r = httpx.post(f"{base_url}/echo", content=chunks(),
                   headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert assert_envelope(r, 413)["code"] == "request_too_large"


def test_a_chunked_body_under_the_limit_is_read_whole(base_url: str) -> None:
    text = b'{"model": "chunked", "messages": [{"role": "user", "content": "hi"}]}'

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(text), 7):
            yield text[i:i + 7]

    r = httpx.post(f"{base_url}/echo", content=chunks(),
                   headers={"content-type": "application/json"})
    assert r.json() == {"model": "chunked"}


def test_a_body_at_the_limit_passes_the_limit(base_url: str) -> None:
    padded = {**GOOD, "user": "u" * (LIMIT - 200)}
    r = httpx.post(f"{base_url}/echo", json=padded)
    assert r.status_code == 200, r.text


def test_the_image_routes_take_larger_bodies_only_while_a_model_reads_images() -> None:
    settings = load_settings()
    text = Registry.parse('[models."m"]\npool = "p"\ncontext_length = 100\n', "t")
    eyes = Registry.parse('[models."m"]\npool = "p"\ncontext_length = 100\nvision = true\n', "t")
    small, large = settings.gateway.max_body_bytes, settings.images.max_body_bytes
    assert small < large
    assert _body_limit(settings, text, "/v1/chat/completions") == small
    assert _body_limit(settings, eyes, "/v1/chat/completions") == large
    assert _body_limit(settings, eyes, "/v1/responses") == large
    assert _body_limit(settings, eyes, "/v1/completions") == small
