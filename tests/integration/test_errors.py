"""Every failure reaches the client as OpenAI's error envelope with the right status."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import Pipeline

pytestmark = pytest.mark.integration


def post(p: Pipeline, body: object, path: str = "/v1/chat/completions",
         **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else None
    return httpx.post(f"{p.base_url}{path}", timeout=60, headers=headers,
                      content=content, json=None if content is not None else body)


def assert_envelope(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_malformed_json_is_400(pipeline: Pipeline) -> None:
    r = post(pipeline, b'{"model": "smollm2", "messages": [',
             **{"content-type": "application/json"})
    assert_envelope(r, 400)


def test_missing_field_is_400_naming_it(pipeline: Pipeline) -> None:
    err = assert_envelope(post(pipeline, {"model": "smollm2"}), 400)
    assert err["param"] == "messages"


def test_bad_role_is_400_from_preprocess(pipeline: Pipeline) -> None:
    err = assert_envelope(post(pipeline, {
        "model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    assert err["param"] == "messages[0].role"


def test_unknown_model_is_404(pipeline: Pipeline) -> None:
    assert_envelope(post(pipeline, {
        "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
        404, "model_not_found")


def test_prompt_over_the_context_is_400(pipeline: Pipeline) -> None:
    huge = "word " * 5000
    assert_envelope(post(pipeline, {
        "model": "smollm2", "messages": [{"role": "user", "content": huge}]}),
        400, "context_length_exceeded")
    assert_envelope(post(pipeline, {"model": "smollm2", "max_tokens": 4000,
                                    "messages": [{"role": "user", "content": "hi"}]}),
                    400, "context_length_exceeded")


def test_no_live_worker_is_503(pipeline: Pipeline) -> None:
    r = post(pipeline, {"model": "ghost", "messages": [{"role": "user", "content": "hi"}]})
    assert_envelope(r, 503, "no_worker_available")


def test_deadline_is_504_streaming_or_not(pipeline: Pipeline) -> None:
    body = {"model": "smollm2", "max_tokens": 400, "temperature": 1.0,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    assert_envelope(post(pipeline, body, **{"X-Conveyor-Timeout": "0.3"}),
                    504, "deadline_exceeded")
    r = post(pipeline, {**body, "stream": True}, **{"X-Conveyor-Timeout": "0.001"})
    assert_envelope(r, 504, "deadline_exceeded")


def test_unsupported_parameters_are_refused(pipeline: Pipeline) -> None:
    assert_envelope(post(pipeline, {"model": "smollm2", "n": 2,
                                    "messages": [{"role": "user", "content": "hi"}]}), 400)
    assert_envelope(post(pipeline, {"model": "smollm2", "prompt": "hi", "echo": True},
                         path="/v1/completions"), 400)


def test_a_pool_without_workers_does_not_hold_up_the_others(pipeline: Pipeline) -> None:
    from concurrent.futures import ThreadPoolExecutor

    ghost = {"model": "ghost", "messages": [{"role": "user", "content": "hi"}]}
    real = {"model": "smollm2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(post, pipeline, ghost)
        time.sleep(0.3)  # the ghost request is parked in schedule by now
        started = time.monotonic()
        answered = post(pipeline, real)
        took = time.monotonic() - started
        assert answered.status_code == 200
        assert not waiting.done(), "the ghost request should still be waiting for a worker"
        assert_envelope(waiting.result(), 503, "no_worker_available")
    assert took < 2.5  # well inside the 3 s the ghost request waits
