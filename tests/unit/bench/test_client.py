"""The load generator's HTTP client (bench/client.py) against the benchmark's
upstream fixture served by uvicorn in a thread: streamed completions timed,
connections kept alive and replaced when the server closed them, failures
returned as samples."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import orjson
import pytest

from bench.client import StreamClient, stream_completion
from bench.harness import loop_factory
from bench.upstream import build_app
from tests.support.asgi import serving
from tests.support.services import free_port

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """On the loop the benchmarks run on (uvloop)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


BODY = {"model": "bench@0", "prompt": "hi", "max_tokens": 8, "stream": True}


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serving(build_app(32, 0.0), timeout_keep_alive=1) as port:
        yield f"http://127.0.0.1:{port}"


def test_streams_are_timed_and_their_text_counted_over_kept_alive_connections(
        upstream: str) -> None:
    async def go() -> tuple[list[int], list[float], int]:
        async with StreamClient(connections=4) as client:
            samples = await asyncio.gather(*[
                stream_completion(client, f"{upstream}/v1/completions",
                                  {**BODY, "max_tokens": 1 + i % 8}) for i in range(40)])
            idle = sum(len(c) for c in client._idle.values())
        assert all(s.ok for s in samples), [s.error for s in samples if not s.ok]
        return [s.chars for s in samples], [s.ttft - s.total for s in samples], idle

    chars, ttft_minus_total, idle = run(go())
    assert chars == [len(" tok") * (1 + i % 8) for i in range(40)]
    assert all(d <= 0 for d in ttft_minus_total)
    assert idle == 4  # 40 requests over the 4 connections the client may open


def test_a_connection_the_server_closed_while_idle_is_replaced(upstream: str) -> None:
    async def go() -> list[bool]:
        async with StreamClient(connections=1) as client:
            url = f"{upstream}/v1/chat/completions"
            body = {"model": "bench@0", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3, "stream": True}
            first = await stream_completion(client, url, body)
            await asyncio.sleep(2.5)  # past the server's keep-alive of 1 s
            second = await stream_completion(client, url, body)
            return [first.ok, second.ok, second.chars == len(" tok") * 3]

    assert run(go()) == [True, True, True]


def test_a_sample_keeps_the_answer_and_the_usage_tokens(upstream: str) -> None:
    body = {"model": "bench@0", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}

    async def go() -> tuple[str, int]:
        async with StreamClient(connections=1) as client:
            sample = await stream_completion(client, f"{upstream}/v1/chat/completions", body)
        return sample.text, sample.tokens

    assert run(go()) == (" tok" * 3, 3)


def test_failures_come_back_as_samples(upstream: str) -> None:
    async def go() -> list[str | None]:
        async with StreamClient(connections=2, timeout_s=5) as client:
            missing = await stream_completion(client, f"{upstream}/v1/nothing", BODY)
            refused = await stream_completion(client, f"http://127.0.0.1:{free_port()}/v1", BODY)
            still = await stream_completion(client, f"{upstream}/v1/completions", BODY)
            return [missing.error, refused.error, still.error]

    missing, refused, still = run(go())
    assert missing is not None and missing.startswith("HTTP 404")
    assert refused is not None and refused.startswith("ConnectionRefusedError"), refused
    assert still is None


async def _echo_auth(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Streams the request's Authorization header back as one completion chunk."""
    if scope["type"] != "http":
        return
    auth = dict(scope["headers"]).get(b"authorization", b"").decode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    chunk = orjson.dumps({"choices": [{"text": auth}]})
    await send({"type": "http.response.body", "body": b"data: " + chunk + b"\n\n",
                "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def test_the_client_headers_go_with_every_request() -> None:
    async def go(port: int) -> list[int]:
        async with StreamClient(connections=1) as client:
            client.headers["Authorization"] = "Bearer sk-bench"
            samples = [await stream_completion(client, f"http://127.0.0.1:{port}/", BODY)
                       for _ in range(3)]
            assert all(s.ok for s in samples), samples
            return [s.chars for s in samples]

    with serving(_echo_auth, lifespan="off") as port:
        assert run(go(port)) == [len("Bearer sk-bench")] * 3
