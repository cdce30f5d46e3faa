"""The Files API's edge, on the gateway's own application (``build_app``)
through httpx's ASGI transport (no server, and no Kafka: the file routes need
none): the upload body limit and the 2 MiB limit everywhere else, uploads
streamed through the body limit, the errors of malformed requests, and the
OpenAPI document. The round trip with the ``openai`` client over real HTTP is
in tests/pipeline/test_files.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from fastapi import FastAPI
from openai.resources.files import AsyncFiles
from starlette.types import Message, Receive, Scope, Send

from conveyor.settings import load_settings
from gateway.app import build_app
from gateway.files.api_router import MULTIPART_ALLOWANCE
from gateway.limits import BodyLimit
from tests.support.gateway_fakes import offline_services

MAX_FILE = 64 * 1024
MAX_BODY = 16 * 1024


@pytest.fixture
def app(tmp_path: Path) -> FastAPI:
    settings = load_settings(files_dir=tmp_path / "files", max_file_bytes=MAX_FILE,
                        max_body_bytes=MAX_BODY)
    app = build_app(settings)
    app.state.services = offline_services(settings)
    return app


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://conveyor") as http:
        yield http


@pytest.fixture
async def files(app: FastAPI) -> AsyncIterator[AsyncFiles]:
    """The ``openai`` client's files resource (it speaks httpx2) on the same app."""
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                  base_url="http://conveyor") as http:
        yield openai.AsyncOpenAI(api_key="unused", base_url="http://conveyor/v1",
                                 http_client=http, max_retries=0).files


def batch_lines(size: int) -> bytes:
    """A valid batch file of exactly ``size`` bytes."""
    line = b'{"custom_id": "x", "body": {}}\n'
    body = line * (size // len(line))
    return body + b" " * (size - len(body))


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def test_a_file_larger_than_any_other_body_is_taken(files: AsyncFiles) -> None:
    data = batch_lines(MAX_FILE)  # four times max_body_bytes, and exactly the file limit
    created = await files.create(file=("in.jsonl", data), purpose="batch")
    assert created.bytes == MAX_FILE
    assert (await files.content(created.id)).content == data


async def test_other_paths_keep_the_body_limit(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", content=b"{" + b" " * MAX_BODY + b"}",
                          headers={"content-type": "application/json"})
    assert error_of(r, 413)["code"] == "request_too_large"
    assert str(MAX_BODY) in r.json()["error"]["message"]


async def test_a_file_over_the_limit_is_413(files: AsyncFiles) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        await files.create(file=("in.jsonl", batch_lines(MAX_FILE + 1)), purpose="batch")
    assert caught.value.status_code == 413
    assert caught.value.code == "request_too_large"
    assert (await files.list()).data == []


async def test_a_declared_body_over_the_limit_is_refused_unread(
        client: httpx.AsyncClient) -> None:
    pulled = 0

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        for _ in range(100):
            pulled += 1
            yield b"x" * 1024

    declared = MAX_FILE + MULTIPART_ALLOWANCE + 1
    r = await client.post("/v1/files", content=body(), headers={
        "content-type": "multipart/form-data; boundary=b", "content-length": str(declared)})
    assert error_of(r, 413)["code"] == "request_too_large"
    assert f"{declared} bytes" in r.json()["error"]["message"]
    assert pulled <= 1


async def test_a_chunked_upload_is_cut_off_at_the_limit(client: httpx.AsyncClient) -> None:
    pulled = 0
    total = (MAX_FILE + MULTIPART_ALLOWANCE) // 1024 + 50

    async def body() -> AsyncIterator[bytes]:
        nonlocal pulled
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
        for _ in range(total):
            pulled += 1
            yield b"x" * 1024

    r = await client.post("/v1/files", content=body(),
                          headers={"content-type": "multipart/form-data; boundary=b"})
    assert "content-length" not in r.request.headers
    assert error_of(r, 413)["code"] == "request_too_large"
    assert pulled < total


def test_an_upload_streams_through_the_body_limit() -> None:
    """The upload path gets the body as it came, message by message; every other
    path gets it whole, once (and a GET of the upload path is no upload)."""
    seen: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            seen.append(message)
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    limit = BodyLimit(app, max_bytes=100, uploads={"/up": 10_000})

    def call(method: str, path: str, parts: list[bytes]) -> list[bytes]:
        seen.clear()
        messages: Iterator[Message] = iter(
            [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
             for i, p in enumerate(parts)])

        async def receive() -> Message:
            return next(messages)

        async def send(message: Message) -> None:
            pass

        asyncio.run(limit({"type": "http", "method": method, "path": path, "headers": []},
                          receive, send))
        return [m["body"] for m in seen]

    parts = [b"a" * 40, b"b" * 40, b"c" * 40]
    assert call("POST", "/up", parts) == parts
    assert call("POST", "/other", [b"a" * 40, b"b" * 40]) == [b"a" * 40 + b"b" * 40]
    assert call("GET", "/up", parts) == []  # 120 > 100: refused before the app runs


@pytest.mark.parametrize(("query", "param"), [
    ("limit=0", "limit"), ("limit=10001", "limit"), ("order=sideways", "order"),
    ("after=file-123", "after"), ("after=../etc", "after"),
])
async def test_a_bad_listing_query_is_400(client: httpx.AsyncClient, query: str,
                                          param: str) -> None:
    assert error_of(await client.get(f"/v1/files?{query}"), 400)["param"] == param


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"data": {"purpose": "batch"}}, "file"),
    ({"files": {"file": ("in.jsonl", b'{"a": 1}\n')}}, "purpose"),
    ({"data": {"purpose": "batch"}, "files": {"file": ("in.jsonl", b"")}}, "file"),
    ({"data": {"purpose": "batch"}, "files": {"notfile": ("in.jsonl", b'{"a": 1}\n')}},
     "file"),
    ({"json": {"purpose": "batch", "file": '{"a": 1}'}}, "purpose"),
])
async def test_a_malformed_upload_is_400(client: httpx.AsyncClient, kwargs: dict[str, Any],
                                         param: str) -> None:
    assert error_of(await client.post("/v1/files", **kwargs), 400)["param"] == param


async def test_two_files_in_one_upload_are_400(client: httpx.AsyncClient) -> None:
    files = [("file", ("a.jsonl", b'{"a": 1}\n')), ("file", ("b.jsonl", b'{"b": 1}\n'))]
    r = await client.post("/v1/files", data={"purpose": "batch"}, files=files)
    assert error_of(r, 400)["type"] == "invalid_request_error"
    assert (await client.get("/v1/files")).json()["data"] == []


async def test_content_is_sent_as_bytes_of_known_length(client: httpx.AsyncClient) -> None:
    data = batch_lines(3000)
    r = await client.post("/v1/files", data={"purpose": "batch"},
                          files={"file": ("in.jsonl", data)})
    file_id = r.json()["id"]
    got = await client.get(f"/v1/files/{file_id}/content")
    assert got.status_code == 200 and got.content == data
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.headers["content-length"] == "3000"
    missing = await client.get("/v1/files/file-000000000000000000000000/content")
    assert error_of(missing, 404)["code"] == "file_not_found"


async def test_the_openapi_document_describes_the_files_api(
        client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    paths = doc["paths"]
    assert set(paths["/v1/files"]) == {"get", "post"}
    assert set(paths["/v1/files/{file_id}"]) == {"get", "delete"}
    assert "get" in paths["/v1/files/{file_id}/content"]
    upload = paths["/v1/files"]["post"]
    schema = upload["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert schema["required"] == ["file", "purpose"]
    assert {"200", "400", "413"} <= set(upload["responses"])
    assert "422" not in upload["responses"]
