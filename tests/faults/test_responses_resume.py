"""Resuming a Responses API stream on the real pipeline, with the official client
(``client.responses.retrieve(id, stream=True, starting_after=N)``).

The Responses API has no ``seed``, and the llama.cpp engine reuses the prompt
prefix of what a context served before for unseeded requests, so two runs of
the same greedy request may answer differently (tests/pipeline/
test_responses.py says more). What an uninterrupted client receives is
therefore shown on one response: its live stream read whole equals the same
stream read back from the log, and a stream dropped after three events and
resumed equals its own whole read-back, event for event, with contiguous
sequence numbers and the final response's text the concatenated deltas."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import openai
import pytest

from tests.support.pipeline import ROOT, Pipeline

ASK: dict[str, Any] = {"model": "smollm2", "temperature": 0, "max_output_tokens": 40,
                       "instructions": "Answer in two sentences.",
                       "input": "Name the planets of the solar system."}
# runs on to its budget (it counts), long enough to outlive a short grace
COUNTING: dict[str, Any] = {"model": "smollm2", "temperature": 0, "max_output_tokens": 300,
                            "instructions": "Continue the sequence up to 500.",
                            "input": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"}


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def dropped_after_three(c: openai.OpenAI, ask: dict[str, Any]) -> list[Any]:
    """The first three events of a stream whose connection is then closed."""
    stream = c.responses.create(stream=True, **ask)
    first: list[Any] = []
    for event in stream:
        first.append(event)
        if len(first) == 3:
            break
    stream.close()
    return first


def resumed(c: openai.OpenAI, response_id: str, after: int | None = None) -> list[Any]:
    if after is None:
        return list(c.responses.retrieve(response_id, stream=True))
    return list(c.responses.retrieve(response_id, stream=True, starting_after=after))


def dumped(events: list[Any]) -> list[dict[str, Any]]:
    return [e.model_dump() for e in events]


def check_joined(events: list[Any]) -> str:
    """No gap, no repeat, a whole response: its text."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text.strip() and final.output_text == text
    opened = events[0].response
    assert final.id == opened.id and final.instructions == opened.instructions
    return text


def test_a_whole_stream_reads_back_from_the_log_as_it_was_sent(pipeline: Pipeline) -> None:
    c = client(pipeline.base_url)
    live = list(c.responses.create(stream=True, **ASK))
    check_joined(live)
    again = resumed(c, live[0].response.id)
    live_end, again_end = live[-1].response.completed_at, again[-1].response.completed_at
    # completed_at: when the gateway read the final reply, or its record time; an
    # answer cut at max_output_tokens is incomplete and has none, live or read back
    assert live[-1].response.status == again[-1].response.status
    if live[-1].response.status == "completed":
        assert live_end is not None and again_end is not None
        assert abs(live_end - again_end) <= 1
    else:
        assert live_end is None and again_end is None
    for events in (live, again):
        events[-1].response.completed_at = None
    assert dumped(again) == dumped(live)


def test_a_dropped_stream_resumes_after_its_last_event(pipeline: Pipeline) -> None:
    c = client(pipeline.base_url)
    first = dropped_after_three(c, ASK)
    assert [e.sequence_number for e in first] == [0, 1, 2]
    response_id = first[0].response.id
    rest = resumed(c, response_id, after=first[-1].sequence_number)
    assert rest[0].sequence_number == 3
    check_joined(first + rest)
    assert dumped(first + rest) == dumped(resumed(c, response_id))
    assert dumped(resumed(c, response_id, after=5)) == dumped(rest[3:])


def test_the_rest_comes_from_another_replica(pipeline: Pipeline) -> None:
    # a short grace: the generation outlives it only because the other replica reads it
    a = pipeline.start_gateway("gateway-resume-a", CONVEYOR_RESUME_GRACE_S="1")
    try:
        started = time.monotonic()
        first = dropped_after_three(client(a), COUNTING)
        rest = resumed(client(pipeline.base_url), first[0].response.id, after=2)
        took = time.monotonic() - started
        check_joined(first + rest)
        final = rest[-1].response
        assert final.status == "incomplete" and final.usage is not None
        assert final.usage.output_tokens == COUNTING["max_output_tokens"]
        assert dumped(first + rest) == dumped(resumed(client(a), final.id))
        assert took > 2, f"the answer took {took:.1f} s: too short to outlive the grace"
    finally:
        pipeline.kill("gateway-resume-a", signal.SIGTERM)


def test_the_rest_comes_from_another_replica_after_a_sigkill(pipeline: Pipeline) -> None:
    url = pipeline.start_gateway("gateway-resume-k")
    try:
        stream = client(url).responses.create(stream=True, **COUNTING)
        first: list[Any] = []
        for event in stream:
            first.append(event)
            if len(first) == 3:
                pipeline.kill("gateway-resume-k")  # SIGKILL, mid-answer
                break
        stream.close()
        rest = resumed(client(pipeline.base_url), first[0].response.id, after=2)
        check_joined(first + rest)
        final = rest[-1].response
        assert final.status == "incomplete" and final.usage is not None
        assert final.usage.output_tokens == COUNTING["max_output_tokens"]
        assert dumped(first + rest) == dumped(resumed(client(pipeline.base_url), final.id))
    finally:
        if pipeline.procs["gateway-resume-k"].poll() is None:
            pipeline.kill("gateway-resume-k")


def test_unknown_and_background_responses_are_not_streamed(pipeline: Pipeline) -> None:
    c = client(pipeline.base_url)
    with pytest.raises(openai.NotFoundError):
        resumed(c, f"resp_{uuid.uuid4().hex}")
    queued = c.responses.create(background=True, **{**ASK, "max_output_tokens": 4})
    with pytest.raises(openai.BadRequestError) as info:
        resumed(c, queued.id)
    assert "background" in info.value.message and info.value.param == "stream"
    assert c.responses.retrieve(queued.id).id == queued.id  # without stream, as before


def test_only_the_responses_tenant_may_stream_it(pipeline: Pipeline) -> None:
    env = {"CONVEYOR_AUTH": "keys",
           "CONVEYOR_AUTH_SECRET": f"conveyor-test-resume-{uuid.uuid4().hex}"}

    def key(tenant: str) -> str:
        out = subprocess.run([sys.executable, "-m", "cli", "keys", "create", "--tenant",
                              tenant, "--name", "resume"], env={**pipeline.env, **env}, cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        found = re.search(r"cvy-\S+", out.strip().splitlines()[-1])
        assert found is not None, out
        return found.group(0)

    url = pipeline.start_gateway("gateway-resume-keys", **env)
    try:
        owner = client(url, key(f"t{uuid.uuid4().hex[:8]}"))
        stranger = client(url, key(f"t{uuid.uuid4().hex[:8]}"))
        original = list(owner.responses.create(stream=True, **{**ASK, "max_output_tokens": 4}))
        response_id = original[0].response.id
        with pytest.raises(openai.NotFoundError):
            resumed(stranger, response_id)
        with pytest.raises(openai.NotFoundError):
            resumed(stranger, response_id, after=2)
        again = resumed(owner, response_id)
        assert [e.type for e in again] == [e.type for e in original]
        assert check_joined(again) == check_joined(original)
    finally:
        pipeline.kill("gateway-resume-keys", signal.SIGTERM)
