"""Every error on ``/v1/messages`` in Anthropic's shape, with its status, under a
real HTTP server; the same failures elsewhere keep OpenAI's envelope. The
routes are stand-ins that fail on purpose; the middleware and handlers are the
gateway's own, and the unmodified ``anthropic`` client reads the errors."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest
from fastapi import FastAPI

from conveyor.errors import (
    InvalidApiKey,
    ModelNotFound,
    Overloaded,
    RateLimited,
    RequestError,
)
from gateway.errors import install_error_handlers
from gateway.limits import BodyLimit
from gateway.messages.errors import AnthropicErrors, anthropic_error

FAILURES: dict[str, RequestError] = {
    "key": InvalidApiKey("Incorrect API key provided."),
    "model": ModelNotFound("The model `x` does not exist.", param="model"),
    "limit": RateLimited("Rate limit reached.", headers={"Retry-After": "3"}),
    "busy": Overloaded("Every worker is busy."),
}


def edge_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodyLimit, max_bytes=1024)
    install_error_handlers(app)
    app.add_middleware(AnthropicErrors)

    @app.post("/v1/messages")
    async def messages(fail: str) -> dict[str, str]:
        if fail == "bug":
            raise RuntimeError("a bug")
        raise FAILURES[fail]

    @app.post("/v1/chat/completions")
    async def chat() -> None:
        raise FAILURES["busy"]

    return app


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    from tests.support.asgi import serving

    with serving(edge_app()) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(("fail", "status", "kind"), [
    ("key", 401, "authentication_error"),
    ("model", 404, "not_found_error"),
    ("limit", 429, "rate_limit_error"),
    ("busy", 529, "overloaded_error"),
    ("bug", 500, "api_error"),
])
def test_failures_are_anthropics_errors(base_url: str, fail: str, status: int,
                                        kind: str) -> None:
    r = httpx.post(f"{base_url}/v1/messages", params={"fail": fail}, json={})
    assert r.status_code == status
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
    assert int(r.headers["content-length"]) == len(r.content)
    if fail == "limit":
        assert r.headers["retry-after"] == "3"


def test_the_client_raises_its_own_errors(base_url: str) -> None:
    c = anthropic.Anthropic(base_url=base_url, api_key="k", max_retries=0)
    expected: list[tuple[str, type[anthropic.APIStatusError]]] = [
        ("key", anthropic.AuthenticationError), ("model", anthropic.NotFoundError),
        ("limit", anthropic.RateLimitError), ("busy", anthropic.OverloadedError),
        ("bug", anthropic.InternalServerError)]
    for fail, error in expected:
        with pytest.raises(error) as caught:
            c.post("/v1/messages", cast_to=object, body={}, options={"params": {"fail": fail}})
        assert caught.value.body["type"] == "error"  # type: ignore[index]


def test_edge_failures_on_the_path_too(base_url: str) -> None:
    too_big = httpx.post(f"{base_url}/v1/messages", params={"fail": "key"},
                         content=b"x" * 4096, headers={"content-type": "application/json"})
    assert too_big.status_code == 413
    assert too_big.json()["error"]["type"] == "request_too_large"
    wrong_method = httpx.get(f"{base_url}/v1/messages")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.post(f"{base_url}/v1/messages/count_tokens", json={})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    unparsed = httpx.post(f"{base_url}/v1/messages", json={})  # no ?fail: FastAPI's 422
    assert unparsed.status_code == 400
    assert unparsed.json()["error"]["type"] == "invalid_request_error"


def test_other_paths_keep_openais_envelope(base_url: str) -> None:
    r = httpx.post(f"{base_url}/v1/chat/completions", json={})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"


def test_a_body_already_in_anthropics_shape_is_kept() -> None:
    body = b'{"type":"error","error":{"type":"api_error","message":"x"}}'
    assert anthropic_error(500, body) == (500, body)
    status, text = anthropic_error(502, b"not json", "r1")
    assert status == 502 and b'"request_id":"r1"' in text and b"api_error" in text
