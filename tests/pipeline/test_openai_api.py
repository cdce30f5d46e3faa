"""The OpenAI API through the whole pipeline, driven by the official client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.pipeline import Pipeline, client

QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]



def test_chat_non_streaming_answers_with_usage(pipeline: Pipeline) -> None:
    r = client(pipeline).chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    # SmolLM2-135M in 4 bits answers this one differently with each SIMD level
    # llama.cpp is built for (greedy picks between close logits): only ask for text
    assert (r.choices[0].message.content or "").strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 5
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_chunks_and_usage(pipeline: Pipeline) -> None:
    stream = client(pipeline).chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, seed=11)
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    # the same question without streaming, greedy and seeded (a seeded request is
    # evaluated afresh, not on a reused prefix), gives the same text
    whole = client(pipeline).chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=24, temperature=0, seed=11)
    assert text == whole.choices[0].message.content


def test_sse_wire_format_ends_with_done(pipeline: Pipeline) -> None:
    with httpx.stream("POST", f"{pipeline.base_url}/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": QUESTION, "max_tokens": 8, "stream": True,
    }) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        request_id = r.headers["x-request-id"]
        lines = [line for line in r.iter_lines() if line]
    assert request_id in lines[0]  # chunks carry chatcmpl-<the request id>
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith(("data: ", "id: ", ":")) for line in lines)
    data = [line for line in lines if line.startswith("data: ")]
    ids = [line for line in lines if line.startswith("id: ")]
    assert len(ids) == len(data) - 1  # every event but [DONE] can be resumed after




def test_models_lists_the_registry(pipeline: Pipeline) -> None:
    ids = [m.id for m in client(pipeline).models.list()]
    assert "smollm2-135m-instruct" in ids and "smollm2" in ids  # an alias too


def test_a_model_is_retrieved_by_name_or_alias(pipeline: Pipeline) -> None:
    c = client(pipeline)
    for name in ("smollm2-135m-instruct", "smollm2"):
        found = c.models.retrieve(name)
        assert found.id == name and found.object == "model" and found.owned_by == "conveyor"
    with pytest.raises(openai.NotFoundError) as caught:
        c.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"




def test_stop_sequence_cuts_the_answer(pipeline: Pipeline) -> None:
    c = client(pipeline)
    kw = {"model": "smollm2", "max_tokens": 24, "temperature": 0}
    full = c.completions.create(prompt="1, 2, 3, 4, 5,", **kw).choices[0].text  # type: ignore[arg-type]
    assert " 8" in full
    cut = c.completions.create(prompt="1, 2, 3, 4, 5,", stop=[" 8"], **kw)  # type: ignore[arg-type]
    assert cut.choices[0].text == full[: full.index(" 8")]
    assert cut.choices[0].finish_reason == "stop"
    streamed = c.completions.create(prompt="1, 2, 3, 4, 5,", stop=[" 8"], stream=True,
                                    **kw)  # type: ignore[arg-type]
    assert "".join(p.choices[0].text for p in streamed if p.choices) == cut.choices[0].text


def test_eight_concurrent_requests_all_answered(pipeline: Pipeline) -> None:
    c = client(pipeline)
    questions = [f"Name a fruit that starts with the letter {ch}." for ch in "ABCDEFGH"]

    def ask(q: str) -> tuple[str, str | None]:
        r = c.chat.completions.create(model="smollm2", max_tokens=16, temperature=0,
                                      messages=[{"role": "user", "content": q}])
        return r.id, r.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, questions))
    assert len({rid for rid, _ in answers}) == 8
    assert all(text for _, text in answers)


def test_n_choices_each_with_its_index_and_the_prompt_counted_once(pipeline: Pipeline) -> None:
    c = client(pipeline)
    one = c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6)
    three = c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6, n=3)
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    assert all(choice.message.content for choice in three.choices)
    assert one.usage is not None and three.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert 3 <= three.usage.completion_tokens <= 18  # each choice's, up to 6 each
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens
    done = c.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=4, n=2)
    assert [choice.index for choice in done.choices] == [0, 1]


def test_n_choices_stream_interleaved_then_one_usage_and_done(pipeline: Pipeline) -> None:
    stream = client(pipeline).chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=8, n=3, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({chunk.id for chunk in chunks}) == 1
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and all(texts.values()), texts
    assert sorted(finished) == [0, 1, 2]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.completion_tokens >= 3


def test_n_past_the_limit_or_with_store_is_refused_naming_n(pipeline: Pipeline) -> None:
    c = client(pipeline)
    for extra in ({"n": 9}, {"n": 2, "store": True}):
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4,
                                      **extra)  # type: ignore[arg-type]
        assert info.value.body["param"] == "n", info.value.body  # type: ignore[index]


def test_a_schema_past_a_bound_is_refused_naming_it(pipeline: Pipeline) -> None:
    """A schema nested 100 levels (a checker's RecursionError, a 500, before
    Conveyor bounded it) and an enum of 10,001 values: 400s naming the schema
    and the bound, through the official client."""
    deep: dict[str, object] = {"type": "string"}
    for _ in range(99):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"],
                "additionalProperties": False}
    many = {"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(10_001)]}},
            "required": ["v"], "additionalProperties": False}
    for schema, says in ((deep, "nested 100 levels deep; at most 64"),
                         (many, "10,001 enum values in all; at most 10,000")):
        with pytest.raises(openai.BadRequestError) as info:
            client(pipeline).chat.completions.create(
                model="smollm2", messages=QUESTION, max_tokens=4,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "s", "schema": schema}})
        body = info.value.body
        assert body["param"] == "response_format.json_schema.schema", body  # type: ignore[index]
        assert says in body["message"], body  # type: ignore[index]
