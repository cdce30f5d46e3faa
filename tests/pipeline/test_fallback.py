"""A model whose pool has no worker falls back to the model its registry entry
names: the answer's ``model`` is the one that answered, and
``x-conveyor-fallback`` says a fallback happened (``phantom`` in
tests/data/models.toml falls back to SmolLM2)."""

from __future__ import annotations

import json

import httpx
import openai

from tests.support.pipeline import Pipeline

ANSWERED_BY = "smollm2-135m-instruct"


def test_a_request_for_a_model_without_workers_is_answered_by_its_fallback(
        pipeline: Pipeline) -> None:
    body = {"model": "phantom", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hello."}]}
    r = httpx.post(f"{pipeline.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == ANSWERED_BY and r.json()["choices"][0]["message"]["content"]
    assert r.headers["x-conveyor-fallback"] == ANSWERED_BY
    with httpx.stream("POST", f"{pipeline.base_url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True}) as streamed:
        assert streamed.headers["x-conveyor-fallback"] == ANSWERED_BY
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines()
                  if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {ANSWERED_BY}


def test_the_openai_client_sees_the_model_that_answered(pipeline: Pipeline) -> None:
    client = openai.OpenAI(base_url=f"{pipeline.base_url}/v1", api_key="none", max_retries=0)
    raw = client.completions.with_raw_response.create(model="phantom", prompt="1, 2, 3,",
                                                      max_tokens=3)
    assert raw.headers["x-conveyor-fallback"] == ANSWERED_BY
    assert raw.parse().model == ANSWERED_BY
    own = client.completions.with_raw_response.create(model="smollm2", prompt="1, 2, 3,",
                                                      max_tokens=3)
    assert "x-conveyor-fallback" not in own.headers and own.parse().model == "smollm2"
