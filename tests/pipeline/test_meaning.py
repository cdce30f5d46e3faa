"""Routing and caching by meaning against real processes: an alias of the
applied registry sends a coding prompt and a cooking prompt to their routes'
models and an unrelated prompt to its default (each answer naming its model,
``x-conveyor-route`` saying so, ``conveyor inspect`` showing every route's
score, ``conveyor replay`` computing the same decision); with a policy's
semantic cache on, a paraphrase is answered from the cache at its threshold
and a different question by the model."""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.pipeline import ROOT, TEST_MODELS, Pipeline

DATA = tomllib.loads((ROOT / "tests" / "data" / "meaning.toml").read_text())
CODING = "Write a function in JavaScript that debounces another function."
COOKING = "What is the best way to caramelize onions?"
UNRELATED = "Who won the football World Cup in 2014?"


def registry() -> str:
    routes = DATA["routes"]
    text = TEST_MODELS.read_text() + '''
[models."coder"]
pool = "cpu"
context_length = 2048
default_max_tokens = 64
[models."chef"]
pool = "cpu"
context_length = 2048
default_max_tokens = 64
[models."assistant"]
default = "smollm2"
encoder = "all-minilm-l6-v2"
'''
    for name, model in (("coding", "coder"), ("cooking", "chef")):
        text += (f'routes.{name} = {{ model = "{model}", examples = '
                 f'{json.dumps(routes[name]["examples"])}, keywords = '
                 f'{json.dumps(routes[name]["keywords"])} }}\n')
    return text


@pytest.fixture(scope="module")
def p(module_pipelines: Callable[..., Pipeline], tmp_path_factory: pytest.TempPathFactory
      ) -> Iterator[Pipeline]:
    made = module_pipelines(workers=1, contexts=2)
    models = tmp_path_factory.mktemp("meaning") / "models.toml"
    models.write_text(registry())
    assert "assistant" in made.cli("models", "apply", str(models))
    if "meaning-w" not in made.procs:
        # a running worker names the models its pool had when it started: one
        # started now serves coder and chef too
        made.spawn("meaning-w", "infer", "--pool", "cpu", *made.engine, "--contexts", "2",
                   "--worker-id", "meaning-w")
        made.wait_workers(2)
    until(lambda: ask(made, "Hi").status_code == 200)  # route and preprocess know it
    yield made
    made.cli("models", "apply", str(TEST_MODELS))  # as the file says, for whoever follows


def ask(p: Pipeline, content: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{p.base_url}/v1/chat/completions", timeout=60, json={
        "model": "assistant", "max_tokens": 4,
        "messages": [{"role": "user", "content": content}], **extra})


def until(check: Callable[[], bool], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.2)


def test_the_alias_routes_by_meaning_and_inspect_shows_the_scores(p: Pipeline) -> None:
    answered = {}
    for prompt, model in ((CODING, "coder"), (COOKING, "chef"),
                          (UNRELATED, "smollm2-135m-instruct")):
        r = ask(p, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model and r.headers["x-conveyor-route"] == model
        answered[model] = r.headers["x-request-id"]

    report = json.loads(p.cli("inspect", answered["coder"], "--json"))
    meaning = report["meaning"]
    assert (meaning["alias"], meaning["method"], meaning["route"], meaning["model"],
            meaning["floor"]) == ("assistant", "embedding", "coding", "coder", 0.6)
    scores = {s["route"]: s["score"] for s in meaning["scores"]}
    assert scores["coding"] >= 0.6 > scores["cooking"]
    assert "routed by meaning (embedding, floor 0.6): assistant -> chef (route cooking)" \
        in p.cli("inspect", answered["chef"])
    unrelated = json.loads(p.cli("inspect", answered["smollm2-135m-instruct"], "--json"))
    assert unrelated["meaning"]["route"] == "" and unrelated["meaning"]["model"] == "smollm2"
    assert all(s["score"] < 0.6 for s in unrelated["meaning"]["scores"])

    # replay re-runs route over the recorded event: the same decision
    replayed = json.loads(p.cli("replay", answered["coder"], "--through", "route", "--json",
                                "--show-content"))
    [layer] = replayed["layers"]
    [pair] = layer["outputs"]
    assert pair["recorded"]["route"]["meaning"] == meaning
    assert pair["replayed"]["route"]["meaning"] == meaning
    assert layer["same"], layer

    bad = httpx.post(f"{p.base_url}/v1/chat/completions", timeout=30,
                     json={"model": "assistant", "messages": "not a list"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_the_semantic_cache_answers_a_paraphrase_and_not_a_different_question(
        p: Pipeline, tmp_path: Path) -> None:
    policy = tmp_path / "semantic.toml"
    policy.write_text("[cache]\nsemantic = true\nttl_s = 300\n")  # at similarity 0.95
    p.cli("policies", "set", "--default", str(policy))
    try:
        question = "How long should I boil an egg?"
        paraphrase = "For how long should I boil an egg?"  # 0.99 alike
        different = "How long should I boil pasta?"  # 0.68
        first = ask(p, question, temperature=0)
        assert first.status_code == 200 and "x-conveyor-cache" not in first.headers
        text = first.json()["choices"][0]["message"]["content"]

        def paraphrased() -> bool:  # the answer is kept once the worker finished it
            r = ask(p, paraphrase, temperature=0)
            return r.headers.get("x-conveyor-cache") == "hit"
        until(paraphrased, within_s=15)
        hit = ask(p, paraphrase, temperature=0)
        assert hit.headers["x-conveyor-cache"] == "hit"
        assert hit.json()["choices"][0]["message"]["content"] == text
        assert hit.json()["model"] == first.json()["model"] == "chef"
        assert "policy: answered from the prompt cache" in \
            p.cli("inspect", hit.headers["x-request-id"])

        other = ask(p, different, temperature=0)
        assert other.status_code == 200 and "x-conveyor-cache" not in other.headers
        assert other.json()["model"] == "chef"
        sampled = ask(p, paraphrase, temperature=0.8)
        assert "x-conveyor-cache" not in sampled.headers
    finally:
        p.cli("policies", "clear", "--default")
