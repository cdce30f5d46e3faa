"""The chaos run's clients (bench/chaos_check.py) over the benchmarks' HTTP
client, against the upstream fixture: every answer recorded whole, an error
answer with its status and code."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from bench.chaos_check import Load, Record
from bench.upstream import build_app
from tests.support.asgi import serving


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serving(build_app(32, 0.0)) as port:
        yield f"http://127.0.0.1:{port}"


def play(upstream: str, max_tokens: int, requests: int) -> list[Record]:
    async def go() -> list[Record]:
        load = Load(upstream, clients=2, max_tokens=max_tokens, max_requests=requests,
                    client_deadline_s=10.0)
        load.start()
        await load.drain()
        return load.records

    return asyncio.run(go())


def test_each_streamed_answer_is_recorded_whole(upstream: str) -> None:
    records = play(upstream, 4, 4)
    assert len(records) == 4
    for r in records:
        assert r.error is None and r.finished, r
        assert r.text == " tok" * 4 and r.finish_reasons == ["length"]
        assert [u["completion_tokens"] for u in r.usages] == [4]
        assert (r.done, r.after_done, len(r.ids)) == (1, 0, 1)
        assert r.request_id is not None and len(r.events) == 4 + 3  # tokens, final, usage, [DONE]


def test_an_answer_other_than_200_is_an_http_error_with_its_code(upstream: str) -> None:
    [record] = play(upstream, 0, 1)
    assert (record.error_kind, record.code, record.error_code) == (
        "http", 400, "invalid_request_error")
    assert record.error is not None and record.error.startswith("HTTP 400: {")
