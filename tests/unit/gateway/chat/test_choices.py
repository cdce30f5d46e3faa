"""n > 1 (gateway/chat/serving.py): each choice's generation, and the answers
put together as one."""

from __future__ import annotations

from typing import Any

from gateway.chat.serving import choice_generations, merged_response
from schemas.openai.requests import MAX_INT64, MIN_INT64
from tests.support.factories import generation


def test_a_seeded_request_gives_each_choice_its_own_seed() -> None:
    seeded = generation(None)
    seeded["sampling"]["seed"] = 41
    assert [g["sampling"]["seed"] for g in choice_generations(seeded, 3)] == [41, 42, 43]
    assert seeded["sampling"]["seed"] == 41  # the request's own is left alone
    edge = generation(None)
    edge["sampling"]["seed"] = MAX_INT64
    assert [g["sampling"]["seed"] for g in choice_generations(edge, 2)] == [MAX_INT64,
                                                                            MIN_INT64]
    unseeded = choice_generations(generation(None), 2)
    assert [g["sampling"]["seed"] for g in unseeded] == [None, None]


def answer(text: str, completion: int) -> dict[str, Any]:
    return {"id": f"chatcmpl-{text}", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 10, "completion_tokens": completion,
                      "total_tokens": 10 + completion,
                      "prompt_tokens_details": {"cached_tokens": 0}}}


def test_the_answers_are_one_with_an_index_each_and_the_prompt_counted_once() -> None:
    merged = merged_response([answer("a", 3), answer("b", 5), answer("c", 1)])
    assert merged["id"] == "chatcmpl-a"
    assert [(c["index"], c["message"]["content"]) for c in merged["choices"]] == [
        (0, "a"), (1, "b"), (2, "c")]
    assert merged["usage"]["prompt_tokens"] == 10
    assert (merged["usage"]["completion_tokens"], merged["usage"]["total_tokens"]) == (9, 19)
