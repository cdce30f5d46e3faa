"""Every failure reaches the client as OpenAI's error envelope with the right status."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.support.pipeline import Pipeline


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


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_from_the_pipeline_names_its_request(pipeline: Pipeline, stream: bool) -> None:
    """A request refused after it was submitted (here by preprocess) carries its
    x-request-id, as its answer would: what conveyor inspect knows it by."""
    r = post(pipeline, {"model": "smollm2", "stream": stream,
                        "messages": [{"role": "user", "content": "word " * 5000}]})
    assert_envelope(r, 400, "context_length_exceeded")
    rid = r.headers.get("x-request-id")
    assert rid is not None and len(rid) == 32, r.headers


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
    assert_envelope(post(pipeline, {"model": "smollm2", "n": 9,
                                    "messages": [{"role": "user", "content": "hi"}]}), 400)
    assert_envelope(post(pipeline, {"model": "smollm2", "prompt": "hi", "echo": True},
                         path="/v1/completions"), 400)


def test_a_logit_bias_is_checked_and_an_engine_without_logits_refuses_it(
        pipeline: Pipeline) -> None:
    """Preprocess checks the ids against SmolLM2's 49,152 tokens; the session's
    scripted engine has no logits to bias, and says so."""
    ask = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    err = assert_envelope(post(pipeline, {**ask, "logit_bias": {"49152": 1}}), 400)
    assert err["param"] == "logit_bias" and "49152" in err["message"]
    err = assert_envelope(post(pipeline, {**ask, "logit_bias": {"1": 101}}), 400)
    assert err["param"] == "logit_bias"
    err = assert_envelope(post(pipeline, {**ask, "logit_bias": {"42": -100}}), 400)
    assert err["param"] == "logit_bias" and "scripted" in err["message"]


def test_a_pool_without_workers_does_not_hold_up_the_others(pipeline: Pipeline) -> None:
    from concurrent.futures import ThreadPoolExecutor

    ghost = {"model": "ghost", "messages": [{"role": "user", "content": "hi"}]}
    real = {"model": "smollm2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(post, pipeline, ghost)
        time.sleep(0.3)  # the ghost request is parked in schedule by now
        answered = post(pipeline, real)
        assert answered.status_code == 200
        # answered while the ghost request still waits its 3 s for a worker
        assert not waiting.done(), "the ghost request should still be waiting for a worker"
        assert_envelope(waiting.result(), 503, "no_worker_available")


def one_connection(p: Pipeline) -> httpx.Client:
    return httpx.Client(base_url=p.base_url, timeout=60,
                        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))


def local_port(r: httpx.Response) -> int:
    return int(r.extensions["network_stream"].get_extra_info("client_addr")[1])


HI = [{"role": "user", "content": "hi"}]


def raw(body: str) -> dict[str, Any]:
    """A JSON body written by hand (for escapes such as a lone surrogate)."""
    return {"content": body.encode(), "headers": {"content-type": "application/json"}}


@pytest.mark.parametrize(("body", "param"), [
    ('{"model": "smollm2", "seed": 9223372036854775808, "messages": %s}', "seed"),
    ('{"model": "smollm2", "seed": -9223372036854775809, "messages": %s}', "seed"),
    ('{"model": "smollm2", "max_tokens": 2147483648, "messages": %s}', "max_tokens"),
    ('{"model": "smollm2", "max_completion_tokens": 2147483648, "messages": %s}',
     "max_completion_tokens"),
    ('{"model": "smollm2", "messages": [{"role": "user", "content": "a\\ud800"}]}',
     "messages[0].content"),
    ('{"model": "smollm2", "stop": "\\udc00", "messages": %s}', "stop"),
    ('{"model": "smollm2", "stop": ["x", "\\ud800"], "messages": %s}', "stop[1]"),
    ('{"model": "smollm2\\ud800", "messages": %s}', "model"),
    ('{"model": "smollm2", "user": "\\ud800", "messages": %s}', "user"),
    ('{"model": "smollm2", "stream": "yes", "messages": %s}', "stream"),
    ('{"model": "smollm2", "temperature": "hot", "messages": %s}', "temperature"),
    ('{"model": "smollm2", "tools": [{"type": "function", "function": {"name": "f"}}], '
     '"messages": %s}', "tools"),
    ('{"model": "smollm2", "response_format": {"type": "xml"}, "messages": %s}',
     "response_format.type"),
    ('{"model": "smollm2", "response_format": {"type": "json_schema", "json_schema": '
     '{"name": "a", "schema": {"type": "strin"}}}, "messages": %s}',
     "response_format.json_schema.schema"),
    ('{"model": "smollm2", "logprobs": true, "messages": %s}', "logprobs"),
    ('{"model": "smollm2", "logit_bias": {"1": 5}, "messages": %s}', "logit_bias"),
])
def test_what_the_pipeline_cannot_hold_is_400_and_the_connection_lives(
        pipeline: Pipeline, body: str, param: str) -> None:
    text = body % json.dumps(HI) if "%s" in body else body
    good = {"model": "smollm2", "max_tokens": 1, "messages": HI}
    with one_connection(pipeline) as client:
        r = client.post("/v1/chat/completions", **raw(text))
        err = assert_envelope(r, 400)
        assert err["param"] == param and err["type"] == "invalid_request_error"
        after = client.post("/v1/chat/completions", json=good)
        assert after.status_code == 200, after.text
        assert local_port(r) == local_port(after)


def test_a_lone_surrogate_in_a_prompt_is_400(pipeline: Pipeline) -> None:
    r = post(pipeline, b'{"model": "smollm2", "prompt": "\\ud800"}', path="/v1/completions",
             **{"content-type": "application/json"})
    assert assert_envelope(r, 400)["param"] == "prompt"


def test_a_body_over_the_limit_is_413_before_it_enters(pipeline: Pipeline) -> None:
    huge = {"model": "smollm2", "messages": [{"role": "user", "content": "x" * 5_000_000}]}
    err = assert_envelope(post(pipeline, huge), 413, "request_too_large")
    assert err["type"] == "invalid_request_error"

    def chunked() -> Any:
        yield b'{"model": "smollm2", "messages": [{"role": "user", "content": "'
        for _ in range(300):
            yield b"y" * 10_000
        yield b'"}]}'

    r = httpx.post(f"{pipeline.base_url}/v1/chat/completions", content=chunked(), timeout=60,
                   headers={"content-type": "application/json"})
    assert_envelope(r, 413, "request_too_large")


def test_an_empty_prompt_is_answered(pipeline: Pipeline) -> None:
    r = post(pipeline, {"model": "smollm2", "prompt": "", "max_tokens": 3},
             path="/v1/completions")
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"


def test_the_openapi_document_lists_the_real_responses(pipeline: Pipeline) -> None:
    doc = httpx.get(f"{pipeline.base_url}/openapi.json", timeout=10).json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert {"200", "400", "401", "404", "413", "429", "503", "504"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
        error = responses["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
