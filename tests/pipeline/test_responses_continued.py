"""Responses that continue (``previous_response_id``) and their input items
(``input_items.list``), through the whole pipeline with the official client:
a stored response's conversation (its input, not its instructions, then its
output) goes to the model before the next input, as far back as the chain
goes; each response lists only its own input; a response not stored, or
never made, cannot be continued (404 naming the parameter)."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.support.pipeline import Pipeline, client
from topics.envelope import now_ms
from workers.journey import find_journey, report


async def turns_asked(p: Pipeline, response_id: str) -> list[tuple[str, str]]:
    """The turns the model was given for a response, as the log holds them."""
    rid = response_id.removeprefix("resp_")
    journey = await find_journey(p.settings, rid, now_ms() - 600_000)
    assert journey is not None
    return [(m["role"], m["content"]) for m in report(journey, show_content=True)["prompt"]]


def asked(p: Pipeline, response_id: str) -> list[tuple[str, str]]:
    return asyncio.run(turns_asked(p, response_id))


def test_a_chain_of_responses_gives_the_model_the_whole_conversation(pipeline: Pipeline) -> None:
    c = client(pipeline)
    first = c.responses.create(model="smollm2", input="My name is Ada. Count to 3.",
                               instructions="Be terse.", max_output_tokens=4)
    second = c.responses.create(model="smollm2", input="Now count from 7.",
                                previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id and second.instructions is None
    assert second.output_text
    # the first one's input and answer, not its instructions, then the new input
    assert asked(pipeline, second.id) == [
        ("user", "My name is Ada. Count to 3."), ("assistant", first.output_text),
        ("user", "Now count from 7.")]
    third = c.responses.create(model="smollm2", input="And from 20.",
                               instructions="Answer in numbers.",
                               previous_response_id=second.id, max_output_tokens=4)
    assert asked(pipeline, third.id) == [
        ("system", "Answer in numbers."),
        ("user", "My name is Ada. Count to 3."), ("assistant", first.output_text),
        ("user", "Now count from 7."), ("assistant", second.output_text),
        ("user", "And from 20.")]
    # a stored response read back says what it continued
    assert c.responses.retrieve(third.id).previous_response_id == second.id


def test_each_response_lists_only_its_own_input(pipeline: Pipeline) -> None:
    c = client(pipeline)
    first = c.responses.create(model="smollm2", instructions="Be terse.", max_output_tokens=2,
                               input=[{"role": "user", "content": "One."},
                                      {"role": "assistant", "content": "Two."},
                                      {"role": "user", "content": "Three."}])
    second = c.responses.create(model="smollm2", input="Four.", previous_response_id=first.id,
                                max_output_tokens=2)
    newest_first = c.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].text) for i in newest_first.data] == [  # type: ignore[union-attr]
        ("message", "user", "Three."), ("message", "assistant", "Two."),
        ("message", "user", "One.")]
    assert [i.content[0].type for i in newest_first.data] == [  # type: ignore[union-attr]
        "input_text", "output_text", "input_text"]
    page = c.responses.input_items.list(first.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["One.", "Two."]  # type: ignore[union-attr]
    assert page.has_more and page.last_id == page.data[-1].id
    rest = c.responses.input_items.list(first.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["Three."]  # type: ignore[union-attr]
    assert not rest.has_more
    # the page iterator walks every page
    assert len(list(c.responses.input_items.list(first.id, limit=1))) == 3
    [own] = c.responses.input_items.list(second.id).data
    assert own.content[0].text == "Four."  # type: ignore[union-attr]


def test_what_was_not_stored_or_never_made_cannot_be_continued(pipeline: Pipeline) -> None:
    c = client(pipeline)
    unstored = c.responses.create(model="smollm2", input="Hi", store=False, max_output_tokens=2)
    for previous in (unstored.id, "resp_" + "0" * 32, "not-a-response-id"):
        with pytest.raises(openai.NotFoundError) as missing:
            c.responses.create(model="smollm2", input="Hi again", previous_response_id=previous,
                               max_output_tokens=2)
        assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert f"Previous response with id '{previous}' not found." in str(missing.value)
    with pytest.raises(openai.NotFoundError):
        c.responses.input_items.list(unstored.id)
    with pytest.raises(openai.BadRequestError):
        c.responses.input_items.list(unstored.id, limit=101)


def test_a_background_response_continues_once_it_has_completed(pipeline: Pipeline) -> None:
    c = client(pipeline)
    long = c.responses.create(model="smollm2", input="Count from 1.", max_output_tokens=300,
                              background=True)
    with pytest.raises(openai.BadRequestError) as early:  # queued or still in progress
        c.responses.create(model="smollm2", input="Go on.", previous_response_id=long.id,
                           max_output_tokens=2)
    assert early.value.body["param"] == "previous_response_id"  # type: ignore[index]
    c.responses.cancel(long.id)
    first = c.responses.create(model="smollm2", input="My name is Ada. Count to 3.",
                               instructions="Be terse.", max_output_tokens=4, background=True)
    deadline = time.monotonic() + 120
    while (done := c.responses.retrieve(first.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, done
        time.sleep(0.3)
    assert done.status == "incomplete" and done.output_text  # its 4 tokens
    second = c.responses.create(model="smollm2", input="Now count from 7.",
                                previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id and second.output_text
    assert asked(pipeline, second.id) == [
        ("user", "My name is Ada. Count to 3."), ("assistant", done.output_text),
        ("user", "Now count from 7.")]
    [own] = c.responses.input_items.list(first.id).data
    assert own.content[0].text == "My name is Ada. Count to 3."  # type: ignore[union-attr]


def test_a_direct_response_still_streaming_is_continued_once_its_answer_is_whole(
        pipeline: Pipeline) -> None:
    c = client(pipeline)
    events = c.responses.create(model="smollm2", input="Count from 1 to 100.",
                                max_output_tokens=120, stream=True)
    created = next(iter(events))
    assert created.type == "response.created"
    first_id = created.response.id
    # asked while the first still streams: it waits for the first's whole answer
    second = c.responses.create(model="smollm2", input="Go on.",
                                previous_response_id=first_id, max_output_tokens=2)
    rest = list(events)
    ended = rest[-1]
    assert ended.type == "response.incomplete"  # at its 120 tokens, seconds after
    assert second.previous_response_id == first_id
    assert asked(pipeline, second.id) == [
        ("user", "Count from 1 to 100."), ("assistant", ended.response.output_text),
        ("user", "Go on.")]
