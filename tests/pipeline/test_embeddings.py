"""``POST /v1/embeddings`` through real processes, judged by the official
``openai`` client: all-MiniLM-L6-v2 in the encoder engine (pool ``embed`` of
tests/data/models.toml), behind the gateway, the layers and a worker of its own;
errors in OpenAI's envelope; the usage record the ledger counts; the journey
``conveyor inspect`` shows."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import time
from collections.abc import Callable

import httpx
import numpy as np
import openai
import pytest

from cli import inspect as cli_inspect
from conveyor.settings import Settings
from schemas.records import UsageRecord
from tests.support.pipeline import Pipeline
from topics.catalog import USAGE
from topics.envelope import now_ms
from topics.lookup import SharedLookup

MODEL = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def p(module_pipelines: Callable[..., Pipeline]) -> Pipeline:
    made = module_pipelines(workers=1, contexts=2)
    if "embed-0" not in made.procs:
        made.spawn("embed-0", "infer", "--engine", "encoder", "--pool", "embed",
                   "--worker-id", "embed-0")
        made.wait_workers(1, pool="embed")
    return made


@pytest.fixture
def client(p: Pipeline) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.base_url}/v1", api_key="unused", max_retries=0)


def unit(vectors: list[list[float]]) -> np.ndarray:
    out = np.asarray(vectors, np.float32)
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-4)
    return out


def test_the_client_gets_vectors_of_the_models_width_closer_for_similar_sentences(
        client: openai.OpenAI) -> None:
    texts = ["The cat sits on the mat.", "A cat is sitting on a rug.",
             "Quarterly revenue rose by ten percent."]
    # the client asks for base64 by default and decodes it
    got = client.embeddings.create(model=MODEL, input=texts)
    assert got.model == MODEL and [d.index for d in got.data] == [0, 1, 2]
    v = unit([d.embedding for d in got.data])
    assert v.shape == (3, 384)
    assert v[0] @ v[1] > 0.6 > 0.2 > max(v[0] @ v[2], v[1] @ v[2])
    assert got.usage.prompt_tokens == got.usage.total_tokens > 3 * 2
    # float, by alias, one string: the same vector
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[0],
                                   encoding_format="float", user="u-1")
    assert np.abs(np.asarray(one.data[0].embedding) - v[0]).max() < 1e-6


def test_base64_is_the_float32_bytes_and_token_ids_embed_as_their_text(
        p: Pipeline, client: openai.OpenAI) -> None:
    r = httpx.post(f"{p.base_url}/v1/embeddings", timeout=60, json={
        "model": MODEL, "input": "hello world", "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    from_b64 = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}  # [CLS] hello world [SEP]
    ids = client.embeddings.create(model=MODEL, input=[7592, 2088], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=[[7592, 2088], [7592]],
                                    encoding_format="float")
    assert np.abs(np.asarray(ids.data[0].embedding) - from_b64).max() < 1e-6
    assert np.abs(np.asarray(many.data[0].embedding) - from_b64).max() < 1e-6
    assert len(many.data) == 2 and many.usage.prompt_tokens == 4 + 3
    assert r.headers["x-request-id"]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": ["ok", ""]}, 400, "input"),
    ({"input": ["x"] * 2049}, 400, "input"),
    ({"input": "word " * 300}, 400, "input"),  # 302 tokens, the model reads 256
    ({"input": [[30522]]}, 400, "input"),  # beyond the vocabulary
    ({"input": "hi", "dimensions": 128}, 400, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "model": "smollm2"}, 400, "model"),  # a chat model
    ({"input": "hi", "model": "no-such-model"}, 404, "model"),
])
def test_bad_input_gets_openais_envelope_never_a_500(
        p: Pipeline, body: dict[str, object], status: int, param: str) -> None:
    r = httpx.post(f"{p.base_url}/v1/embeddings", timeout=60, json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error


def test_an_embedding_model_asked_for_a_chat_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 400 and "embedding model" in str(info.value)


def test_more_vectors_than_an_answer_holds_are_refused_plainly(p: Pipeline) -> None:
    most = (p.settings.kafka.max_event_bytes - 64 * 1024) // (384 * 16 + 64)
    r = httpx.post(f"{p.base_url}/v1/embeddings", timeout=60, json={
        "model": MODEL, "input": ["a"] * (most + 1), "encoding_format": "float"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "base64" in r.json()["error"]["message"]


def run_inspect(settings: Settings, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli_inspect.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["inspect", *argv])
    result: int = args.func(settings, args)
    return result


def test_inspect_shows_the_journey_and_the_usage_record_is_written(
        p: Pipeline, capsys: pytest.CaptureFixture[str]) -> None:
    r = httpx.post(f"{p.base_url}/v1/embeddings", timeout=60, json={
        "model": MODEL, "input": ["one", "two", "three"], "encoding_format": "float"})
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert run_inspect(p.settings, rid, "--json") == 0
    journey = json.loads(capsys.readouterr().out)
    for layer in ("gateway", "preprocess", "route", "schedule", "infer", "postprocess"):
        assert journey["layers"][layer], f"no {layer} event: {journey['layers']}"
    assert journey["worker_id"] == "embed-0"
    records = asyncio.run(usage_records(p.settings, rid, now_ms() - 60_000))
    assert [(u["kind"], u["status"], u["prompt_tokens"], u["completion_tokens"])
            for u in records] == [("embedding", "completed", 9, 0)]


async def usage_records(settings: Settings, rid: str, since_ms: int) -> list[UsageRecord]:
    """The usage events of ``rid``, as the ledger reads them (keyed by tenant:
    every partition is read from ``since_ms``)."""
    lookup = SharedLookup(settings)
    found: list[UsageRecord] = []
    try:
        for _ in range(50):
            found = [u for _, u in await lookup.find(USAGE, None, since_ms)
                     if u["request_id"] == rid]
            if found:
                break
            await asyncio.sleep(0.2)
    finally:
        await lookup.close()
    return found


def test_a_batch_of_embedding_lines_completes_with_the_same_vectors(
        client: openai.OpenAI) -> None:
    texts = ["first line", "second line", "third line"]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MODEL, "input": text, "encoding_format": "float"}}
             for i, text in enumerate(texts)]
    lines.append({"custom_id": "long", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": MODEL, "input": "word " * 300}})  # refused by preprocess
    data = "\n".join(json.dumps(x) for x in lines) + "\n"
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(data.encode())),
                                  purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                                  completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "cancelled", "expired") \
            and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None and batch.error_file_id is not None
    out = {o["custom_id"]: o for o in map(json.loads, client.files.content(
        batch.output_file_id).text.splitlines())}
    assert sorted(out) == ["e0", "e1", "e2"]
    direct = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    for i in range(3):
        body = out[f"e{i}"]["response"]["body"]
        assert out[f"e{i}"]["response"]["status_code"] == 200 and body["object"] == "list"
        assert np.abs(np.asarray(body["data"][0]["embedding"])
                      - np.asarray(direct.data[i].embedding)).max() < 1e-6
    [error] = map(json.loads, client.files.content(batch.error_file_id).text.splitlines())
    assert error["custom_id"] == "long" and error["response"]["status_code"] == 400
