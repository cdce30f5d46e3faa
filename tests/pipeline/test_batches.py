"""The Batch API and background responses through the whole pipeline, driven
by the official ``openai`` client."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import openai
import pytest

from tests.support.pipeline import Pipeline, client

FINAL = ("completed", "failed", "cancelled", "expired")



def line(custom_id: str, content: str = "Say hi.", model: str = "smollm2",
         max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": content}]}}


def upload(c: openai.OpenAI, lines: list[Any]) -> str:
    data = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return c.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch").id


def wait(c: openai.OpenAI, batch_id: str, until: tuple[str, ...] = FINAL,
         timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = c.batches.retrieve(batch_id)
        if batch.status in until or time.monotonic() > deadline:
            return batch
        time.sleep(0.5)


def lines_of(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines() if x.strip()]


def test_a_50_line_batch_completes_with_one_output_line_per_custom_id(
        pipeline: Pipeline) -> None:
    c = client(pipeline)
    file_id = upload(c, [line(f"req-{i}", f"Count to {i % 5 + 1}.") for i in range(50)])
    batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                             completion_window="24h", metadata={"suite": "batches"})
    assert batch.status == "validating" and batch.input_file_id == file_id
    assert any(b.id == batch.id for b in c.batches.list())
    done = wait(c, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (50, 50, 0)
    assert done.metadata == {"suite": "batches"}
    assert done.in_progress_at and done.completed_at and done.finalizing_at
    out = lines_of(c, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(50))
    first = out[0]
    assert first["response"]["status_code"] == 200 and first["error"] is None
    assert first["response"]["body"]["object"] == "chat.completion"
    assert first["response"]["body"]["choices"][0]["message"]["content"]
    assert done.error_file_id is None


def test_bad_lines_end_in_the_error_file_and_nothing_else_does(pipeline: Pipeline) -> None:
    c = client(pipeline)
    lines = [line(f"ok-{i}") for i in range(4)]
    lines.insert(1, line("bad-1", model="no-such-model"))
    lines.append(line("bad-2", model="no-such-model"))
    batch = c.batches.create(input_file_id=upload(c, lines), completion_window="24h",
                             endpoint="/v1/chat/completions")
    done = wait(c, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None and done.request_counts.failed == 2
    errors = lines_of(c, done.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == ["bad-1", "bad-2"]
    assert all(e["response"]["status_code"] == 404 for e in errors)
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_found"
    assert sorted(o["custom_id"] for o in lines_of(c, done.output_file_id)) == \
        [f"ok-{i}" for i in range(4)]


def test_a_malformed_file_fails_validation_naming_the_line(pipeline: Pipeline) -> None:
    c = client(pipeline)
    lines: list[Any] = [line("a"), line("a"), {"custom_id": "c", "method": "GET",
                                                "url": "/v1/chat/completions", "body": {}}]
    batch = c.batches.create(input_file_id=upload(c, lines), completion_window="24h",
                             endpoint="/v1/chat/completions")
    done = wait(c, batch.id)
    assert done.status == "failed"
    assert done.errors is not None and done.errors.data is not None
    assert [(e.line, e.code) for e in done.errors.data] == [(2, "duplicate_custom_id"),
                                                           (3, "invalid_method")]
    assert done.output_file_id is None and done.failed_at


def test_creating_a_batch_checks_its_file_and_endpoint(pipeline: Pipeline) -> None:
    c = client(pipeline)
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id="file-000000000000000000000000",
                         endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=upload(c, [line("a")]), endpoint="/v1/moderations",
                         completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_doesnotexist")


def test_cancel_keeps_what_completed_and_runs_nothing_more(pipeline: Pipeline) -> None:
    c = client(pipeline)
    lines = [line(f"c-{i}", "Write a long story about a river.", max_tokens=48)
             for i in range(30)]
    batch = c.batches.create(input_file_id=upload(c, lines), completion_window="24h",
                             endpoint="/v1/chat/completions")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = c.batches.retrieve(batch.id)
        if now.request_counts is not None and now.request_counts.completed >= 2:
            break
        time.sleep(0.3)
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait(c, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts is not None
    out = lines_of(c, done.output_file_id)
    assert 2 <= len(out) < 30
    assert len(out) == done.request_counts.completed
    assert len({o["custom_id"] for o in out}) == len(out)


def test_a_background_response_is_queued_then_completed(pipeline: Pipeline) -> None:
    c = client(pipeline)
    created = c.responses.create(model="smollm2", input="Name a colour.",
                                 instructions="Answer in one word.", max_output_tokens=8,
                                 background=True)
    assert created.status == "queued" and created.background
    deadline = time.monotonic() + 120
    got = c.responses.retrieve(created.id)
    while got.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.3)
        got = c.responses.retrieve(created.id)
    assert got.status in ("completed", "incomplete"), got
    assert got.output_text
    assert got.usage is not None and got.usage.output_tokens > 0


def test_a_background_response_can_be_cancelled(pipeline: Pipeline) -> None:
    c = client(pipeline)
    created = c.responses.create(model="smollm2", input="Write a very long poem.",
                                 max_output_tokens=400, background=True)
    cancelled = c.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    time.sleep(1.5)
    assert c.responses.retrieve(created.id).status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_doesnotexist")
