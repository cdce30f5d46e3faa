"""What the real model answers, through the whole pipeline: the one pipeline
of the pipeline tier whose worker runs llama.cpp with SmolLM2 (the others run
the scripted engine, which ignores sampling). The engine's own behaviour is
tested without Kafka in tests/engines/workers/infer/engines."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from tests.pipeline.test_responses import check_usage
from tests.support.pipeline import LLAMACPP, Pipeline, client


@pytest.fixture(scope="module")
def model(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("model-logs"), engine=LLAMACPP)
    try:
        yield p.start(workers=1)
    finally:
        p.close()



def test_completions_streaming_and_not(model: Pipeline) -> None:
    c = client(model)
    r = c.completions.create(model="smollm2", prompt="The capital of France is",
                             max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert "Paris" in r.choices[0].text
    parts = list(c.completions.create(model="smollm2", prompt="The capital of France is",
                                      max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text


def test_sampling_parameters_take_effect(model: Pipeline) -> None:
    c = client(model)
    prompt = [{"role": "user", "content": "Write a short poem about the sea."}]

    def ask(**kw: object) -> str:
        r = c.chat.completions.create(model="smollm2", messages=prompt, max_tokens=20, **kw)
        return r.choices[0].message.content or ""

    # the same seed gives the same sample; different seeds (almost surely) differ
    a, b = ask(temperature=1.0, seed=7), ask(temperature=1.0, seed=7)
    assert a == b
    assert any(ask(temperature=1.0, seed=s) != a for s in (8, 9, 10))
    # top_p that keeps only the likeliest token is greedy decoding
    assert ask(temperature=1.0, top_p=1e-9, seed=1) == ask(temperature=0)
    # max_tokens bounds the answer
    r = c.chat.completions.create(model="smollm2", messages=prompt, max_tokens=3)
    assert r.usage is not None and r.usage.completion_tokens <= 3
    assert r.choices[0].finish_reason == "length"


def test_the_stream_helper_gives_the_final_response(model: Pipeline) -> None:
    # a response that ends by itself (the scripted engine's answers run to their budget)
    with client(model).responses.stream(
            model="smollm2", input="Say hello.", max_output_tokens=200, temperature=0,
            instructions="Reply with one short sentence.") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == "".join(texts) and final.output_text.strip()
    check_usage(final)


def test_chat_logprobs_streamed_and_not(model: Pipeline) -> None:
    """Each token's log probability and its three likeliest, as OpenAI's client
    reads them: the tokens make the content, streamed or not, and the greedy
    token is the likeliest. (The two answers are not compared: the second
    reuses the first's cached prompt, and a near tie may fall the other way.)"""
    c = client(model)
    ask: dict[str, Any] = dict(model="smollm2", temperature=0, max_tokens=8, logprobs=True,
                               top_logprobs=3,
                               messages=[{"role": "user", "content": "Name a color."}])
    whole = c.chat.completions.create(**ask).choices[0]
    assert whole.logprobs is not None and whole.logprobs.content
    tokens = whole.logprobs.content
    assert "".join(t.token for t in tokens) == whole.message.content
    for t in tokens:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token
        # probabilities: the three likeliest hold at most all of it
        assert 0 < sum(math.exp(top.logprob) for top in t.top_logprobs) <= 1 + 1e-6
        assert t.bytes is not None and bytes(t.bytes).decode() == t.token
    streamed, content = [], []
    for chunk in c.chat.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
        if chunk.choices:
            content.append(chunk.choices[0].delta.content or "")
    assert streamed and "".join(t.token for t in streamed) == "".join(content)
    assert all(t.top_logprobs[0].token == t.token for t in streamed)
    plain = c.chat.completions.create(**{**ask, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(model: Pipeline) -> None:
    done = client(model).completions.create(model="smollm2", prompt="The capital of France is",
                                            max_tokens=5, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens and "".join(lp.tokens) == done.choices[0].text
    assert lp.token_logprobs and all(x <= 0 for x in lp.token_logprobs)
    assert lp.top_logprobs and all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_response_logprobs_streamed_and_not(model: Pipeline) -> None:
    """The Responses API's output text with its tokens' log probabilities
    (``include`` names them), whole and in the stream's deltas."""
    c = client(model)
    ask: dict[str, Any] = dict(model="smollm2", input="Name a color.", temperature=0,
                               max_output_tokens=6, top_logprobs=2,
                               include=["message.output_text.logprobs"])
    done = c.responses.create(**ask)
    part = done.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs, done
    assert "".join(t.token for t in part.logprobs) == part.text
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in part.logprobs)
    assert done.top_logprobs == 2
    streamed: list[Any] = []
    for event in c.responses.create(**ask, stream=True):
        if event.type == "response.output_text.delta":
            streamed += event.logprobs or []
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response.output[0].content[0]  # type: ignore[union-attr]
    assert streamed and "".join(t.token for t in streamed) == final.text
    assert len(final.logprobs) == len(streamed)
    plain = c.responses.create(model="smollm2", input="Name a color.", max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_a_conversation_whose_context_moved_on_is_served_from_host_memory(
        model: Pipeline) -> None:
    """Three conversations over the worker's two contexts, one after another:
    the third takes the first one's context, whose cache goes to host memory
    (``conveyor infer``'s default ``--host-cache-mib``); the first one's next
    turn finds its whole history there, and the client's usage says so."""
    c = client(model)

    def system(topic: str) -> str:
        return f"You are a guide to {topic}. " + " ".join(
            f"Rule {i}: keep point {i} about {topic} short." for i in range(1, 16))

    history: list[Any] = [{"role": "system", "content": system("lighthouses")},
                          {"role": "user", "content": "Name one."}]
    first = c.chat.completions.create(model="smollm2", messages=history, max_tokens=4,
                                      temperature=0)
    for topic in ("glaciers", "violins"):
        c.chat.completions.create(model="smollm2", max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system(topic)}, {"role": "user", "content": "Hi."}])
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And another?"}]
    again = c.chat.completions.create(model="smollm2", messages=history, max_tokens=4,
                                      temperature=0)
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # the whole first prompt (some 200 tokens) came back, not a template's few
    assert details.cached_tokens >= first.usage.prompt_tokens > 150, (details, first.usage)
