"""A property-style fuzz test of the HTTP API through a real Conveyor.

Hypothesis writes request bodies for ``/v1/chat/completions`` and
``/v1/completions``: every field plausible or wild (wrong types, values past
what the event schema holds, lone surrogates, unsupported OpenAI parameters,
unknown fields, arbitrary JSON). Every answer must be a documented status of
the operation in ``/openapi.json`` with a body matching its documented schema
(or a well-formed SSE stream), never a 5xx, and all of them come over ONE
kept-alive connection that must never be dropped. Generations are kept short
(``max_tokens`` of at most 3 when it is valid), and the run is bounded in
examples and in time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from tests.support.pipeline import Pipeline

EXAMPLES = 120
MIN_CHECKED = 20  # examples checked whatever the budget
BUDGET_S = 50.0  # per route; the remaining examples are skipped past it

SURROGATES = st.sampled_from(["\ud800", "a\udfff", "\udc00b", "x\ud83dy"])
TEXT = st.one_of(st.text(max_size=12), SURROGATES)
WILD_INTS = st.one_of(st.integers(-2, 3), st.sampled_from(
    [2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30]))
JSON_LEAF = st.one_of(st.none(), st.booleans(), WILD_INTS,
                      st.floats(allow_nan=False, allow_infinity=False, width=32), TEXT)
WILD = st.recursive(JSON_LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


def field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes anything at all."""
    return st.one_of(plausible, plausible, plausible, WILD)


MESSAGE = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "system", "assistant", "tool", "wizard"])),
     "content": field(st.one_of(TEXT, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2)))},
    optional={"name": field(TEXT)})

COMMON: dict[str, st.SearchStrategy[Any]] = {
    "temperature": field(st.floats(-0.5, 2.5)),
    "top_p": field(st.floats(0, 1.2)),
    "stop": field(st.one_of(TEXT, st.lists(TEXT, max_size=5))),
    "seed": field(WILD_INTS),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": field(st.integers(0, 2)),
    "user": field(TEXT),
    "metadata": field(st.dictionaries(st.text(max_size=4), TEXT, max_size=2)),
    "store": field(st.booleans()),
    "logit_bias": field(st.dictionaries(st.text(max_size=3), st.integers(-100, 100),
                                        max_size=1)),
    "unknown_field": WILD,
}

CHAT = st.fixed_dictionaries(
    {"model": field(st.sampled_from(["smollm2", "smollm2-135m-instruct"])),
     "messages": field(st.lists(MESSAGE, min_size=0, max_size=3)),
     "max_tokens": field(st.integers(1, 3))},
    optional={**COMMON,
              "max_completion_tokens": field(st.integers(1, 3)),
              "tools": WILD, "tool_choice": field(st.sampled_from(["none", "auto"])),
              "response_format": field(st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object"])})),
              "logprobs": field(st.booleans()), "top_logprobs": WILD,
              "parallel_tool_calls": WILD})

COMPLETION = st.fixed_dictionaries(
    {"model": field(st.sampled_from(["smollm2", "smollm2-135m-instruct"])),
     "prompt": field(st.one_of(TEXT, st.lists(TEXT, max_size=2))),
     "max_tokens": field(st.integers(1, 3))},
    optional={**COMMON, "echo": field(st.booleans()), "suffix": field(TEXT),
              "best_of": field(st.integers(0, 2)), "logprobs": field(st.integers(0, 2))})


PLAIN = st.text(st.characters(codec="utf-8"), max_size=12)
VALID_CHAT = st.fixed_dictionaries(
    {"model": st.sampled_from(["smollm2", "smollm2-135m-instruct", "no-such-model"]),
     "messages": st.lists(st.fixed_dictionaries(
         {"role": st.sampled_from(["user", "system"]), "content": PLAIN}),
         min_size=1, max_size=2),
     "max_tokens": st.integers(1, 3)},
    optional={"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
              "seed": st.integers(-(2**63), 2**63 - 1), "stream": st.booleans(),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
              "stop": st.lists(PLAIN, max_size=4), "user": PLAIN,
              "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
              "response_format": st.just({"type": "text"}), "logprobs": st.just(False)})


class Checker:
    """One kept-alive connection, and the document the answers must match."""

    def __init__(self, p: Pipeline) -> None:
        self.client = httpx.Client(base_url=p.base_url, timeout=120, limits=httpx.Limits(
            max_connections=1, max_keepalive_connections=1))
        self.doc = self.client.get("/openapi.json").json()
        self.ports: set[int] = set()
        self.statuses: dict[int, int] = {}

    def schema(self, path: str, status: int, media: str) -> Draft202012Validator:
        responses = self.doc["paths"][path]["post"]["responses"]
        assert str(status) in responses, f"{status} is not documented for {path}"
        content = responses[str(status)]["content"]
        assert media in content, f"{media} is not documented for {status} on {path}"
        return Draft202012Validator({**content[media]["schema"],
                                     "components": self.doc["components"]})

    def check(self, path: str, body: Any) -> None:
        content = json.dumps(body, ensure_ascii=True).encode()  # escapes carry surrogates
        with self.client.stream("POST", path, content=content,
                                headers={"content-type": "application/json"}) as r:
            raw = r.read()
            self.ports.add(int(r.extensions["network_stream"].get_extra_info(
                "client_addr")[1]))
        assert len(self.ports) == 1, "the server dropped the kept-alive connection"
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{r.status_code} for {body!r}: {raw[:500]!r}"
        media = r.headers["content-type"].split(";")[0]
        validator = self.schema(path, r.status_code, media)
        if media == "text/event-stream":
            for event in _sse_events(raw):
                assert "object" in event or "error" in event, event
        else:
            errors = list(validator.iter_errors(json.loads(raw)))
            assert not errors, f"{raw[:500]!r} does not match: {errors[0].message}"


def _sse_events(raw: bytes) -> Iterator[dict[str, Any]]:
    lines = [line for line in raw.decode().split("\n") if line]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        if line.startswith(":"):
            continue
        if line.startswith("id: "):  # the event's id, to resume after it
            assert ":" in line.removeprefix("id: "), line
            continue
        assert line.startswith("data: "), line
        yield json.loads(line.removeprefix("data: "))


@pytest.fixture(scope="module")
def checker(pipeline: Pipeline) -> Iterator[Checker]:
    c = Checker(pipeline)
    yield c
    c.client.close()


def run_bounded(checker: Checker, path: str, strategy: st.SearchStrategy[Any],
                examples: int = EXAMPLES) -> None:
    started = time.monotonic()

    checked = 0

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(strategy)
    def fuzz(body: Any) -> None:
        nonlocal checked
        # the first examples always run: on a loaded machine generating them can
        # take the whole budget, and a run that checked nothing proves nothing
        if checked < MIN_CHECKED or time.monotonic() - started < BUDGET_S:
            checked += 1
            checker.check(path, body)

    fuzz()


def test_fuzzed_chat_requests(checker: Checker) -> None:
    run_bounded(checker, "/v1/chat/completions", CHAT)
    assert 200 in checker.statuses and 400 in checker.statuses, checker.statuses


def test_fuzzed_completion_requests(checker: Checker) -> None:
    run_bounded(checker, "/v1/completions", COMPLETION)


def test_fuzzed_requests_that_are_valid(checker: Checker) -> None:
    before = dict(checker.statuses)
    run_bounded(checker, "/v1/chat/completions", VALID_CHAT, examples=40)
    served = checker.statuses.get(200, 0) - before.get(200, 0)
    assert served > 10, checker.statuses


def test_fuzzed_bodies_that_are_not_requests(checker: Checker) -> None:
    run_bounded(checker, "/v1/chat/completions", WILD)
