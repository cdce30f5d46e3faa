"""The llama.cpp engines' host-memory cache under a SIGKILL, through a real
Conveyor on the real model (two workers of one context each, the cache on by
default): the worker answering a conversation whose history it holds in host
memory dies in the middle of the next turn; the other worker finishes that
turn (it evaluates the history afresh: the dead worker's cache went with it),
the client gets one whole answer, and the conversation goes on."""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults.test_delivery import assert_continued_elsewhere, kill_its_worker
from tests.support.pipeline import Pipeline, client


@pytest.fixture
def p(model_workers: Pipeline) -> Pipeline:
    return model_workers  # two workers of the real model (tests/conftest.py)


def system(topic: str) -> str:
    return f"You are a guide to {topic}. " + " ".join(
        f"Rule {i}: keep point {i} about {topic} short." for i in range(1, 16))


def test_a_worker_killed_mid_turn_with_histories_in_host_memory(p: Pipeline) -> None:
    c = client(p)
    history: list[Any] = [{"role": "system", "content": system("lighthouses")},
                          {"role": "user", "content": "Name one."}]
    first = c.chat.completions.create(model="smollm2", messages=history, max_tokens=4,
                                      temperature=0)
    for topic in ("glaciers", "violins", "owls"):  # more conversations than contexts
        c.chat.completions.create(model="smollm2", max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system(topic)}, {"role": "user", "content": "Hi."}])
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    killed: list[str] = []
    parts: list[str] = []
    request_id, finish, usage = "", None, None
    for chunk in c.chat.completions.create(model="smollm2", messages=history, max_tokens=150,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        request_id = request_id or chunk.id.removeprefix("chatcmpl-")
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
        if len(parts) == 3 and not killed:
            kill_its_worker(p, request_id, killed)
    assert killed and finish in ("stop", "length"), "".join(parts)
    assert_continued_elsewhere(p, request_id, killed)
    assert usage is not None and usage.completion_tokens >= len([x for x in parts if x])
    # the conversation goes on, on whichever worker is left
    history += [{"role": "assistant", "content": "".join(parts)},
                {"role": "user", "content": "Thanks."}]
    after = c.chat.completions.create(model="smollm2", messages=history, max_tokens=4,
                                      temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length")
