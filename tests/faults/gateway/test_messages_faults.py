"""Anthropic's Messages API under faults, with the unmodified ``anthropic``
client: a streamed message whose worker is SIGKILLed mid-answer is finished by
the other worker, counted on once with one ``message_stop``. Its outages
(Redis flushed, Kafka stopped) are in test_outages.py."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import anthropic
import pytest

from tests.faults.test_delivery import assert_continued_elsewhere, kill_its_worker
from tests.support.pipeline import Pipeline

COUNT = [{"role": "user", "content": "Count on: 1 2 3"}]


def claude(url: str, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture
def p(module_pipelines: Callable[..., Pipeline]) -> Iterator[Pipeline]:
    """Two scripted workers of one context each; what a test killed is started again."""
    shared = module_pipelines(workers=2, contexts=1)
    try:
        yield shared
    finally:
        shared.heal()


def test_a_worker_killed_mid_stream_leaves_one_message_counted_on(p: Pipeline) -> None:
    killed: list[str] = []
    text, stops, deltas, request_id = "", 0, 0, ""
    final: anthropic.types.MessageDeltaEvent | None = None
    stream = claude(p.base_url).messages.create(model="smollm2", max_tokens=150,
                                                messages=COUNT, stream=True)
    for event in stream:
        if event.type == "message_start":
            request_id = event.message.id.removeprefix("msg_")
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
            deltas += 1
            if deltas == 3:
                kill_its_worker(p, request_id, killed)
        elif event.type == "message_delta":
            final = event
        elif event.type == "message_stop":
            stops += 1
    assert killed and stops == 1 and final is not None
    assert final.delta.stop_reason == "max_tokens" and final.usage.output_tokens == 150
    numbers = [int(n) for n in re.findall(r"\d+", text)][:-1]  # the last may be cut
    assert numbers == list(range(4, 4 + len(numbers))) and len(numbers) > 50, text
    assert_continued_elsewhere(p, request_id, killed)
