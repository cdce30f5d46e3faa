"""The OpenAI request models at the edge: what is accepted, normalised or refused."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.errors import InvalidRequest
from schemas.openai.requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    invalid_request,
)


def chat(**fields: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return ChatCompletionRequest.model_validate(body)


def completion(**fields: Any) -> CompletionRequest:
    body: dict[str, Any] = {"model": "smollm2", "prompt": "Once"}
    body.update(fields)
    return CompletionRequest.model_validate(body)


def error_locs(exc: ValidationError) -> set[str]:
    return {str(e["loc"][0]) for e in exc.errors()}


def test_stop_may_be_a_string() -> None:
    assert chat(stop="END").stop_list() == ["END"]


def test_stop_may_be_a_list() -> None:
    assert chat(stop=["a", "b"]).stop_list() == ["a", "b"]


def test_no_stop_is_an_empty_list() -> None:
    assert chat().stop_list() == []
    assert chat(stop=None).stop_list() == []
    assert chat(stop=[]).stop_list() == []


def test_empty_stop_strings_are_dropped() -> None:
    assert chat(stop=["", "x"]).stop_list() == ["x"]
    assert chat(stop="").stop_list() == []


def test_four_stops_are_allowed_five_are_not() -> None:
    assert len(chat(stop=["a", "b", "c", "d"]).stop_list()) == 4
    with pytest.raises(ValidationError) as info:
        chat(stop=["a", "b", "c", "d", "e"])
    assert error_locs(info.value) == {"stop"}
    with pytest.raises(ValidationError):
        completion(stop=["a", "b", "c", "d", "e"])


@pytest.mark.parametrize("n", [0, -1, 9])
def test_up_to_eight_choices_are_served(n: int) -> None:
    with pytest.raises(ValidationError) as info:
        chat(n=n)
    assert error_locs(info.value) == {"n"}
    with pytest.raises(ValidationError):
        completion(n=n)
    assert chat(n=8).choices() == 8 and completion().choices() == 1


def test_a_generation_is_one_choice_s() -> None:
    """Batches and the WebSocket API make their generations here: n=1 only."""
    from schemas.openai.generations import chat_generation, completion_generation

    with pytest.raises(InvalidRequest) as info:
        chat_generation(chat(n=2))
    assert info.value.param == "n"
    with pytest.raises(InvalidRequest):
        completion_generation(completion(n=3))


def test_n_of_one_is_fine() -> None:
    assert chat(n=1).n == 1


def test_content_parts_are_flattened() -> None:
    m = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]})
    assert m.text() == "Hello, world"


def test_message_text_of_a_string_and_of_nothing() -> None:
    assert ChatMessage(role="user", content="plain").text() == "plain"
    assert ChatMessage(role="assistant", content=None).text() == ""
    assert ChatMessage(role="assistant").text() == ""


def test_parts_other_than_text_and_images_are_refused_naming_the_part() -> None:
    with pytest.raises(ValidationError) as caught:
        chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}]}])
    assert invalid_request(caught.value.errors()).param == "messages[0].content[1]"


def test_image_parts_are_read_with_where_they_stand_in_the_text() -> None:
    m = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "left "}, {"type": "image_url", "image_url": {
            "url": "data:image/png;base64,AAAA", "detail": "low"}},
        {"type": "text", "text": "right"}]})
    assert m.text() == "left right"
    ((index, chars, part),) = m.image_parts()
    assert (index, chars, part.image_url.detail) == (1, 5, "low")


def test_an_image_part_needs_a_url_and_a_known_detail() -> None:
    for image_url in ({}, {"url": ""}, {"url": "data:,", "detail": "ultra"}):
        with pytest.raises(ValidationError):
            ChatMessage.model_validate({"role": "user", "content": [
                {"type": "image_url", "image_url": image_url}]})


def test_at_least_one_message() -> None:
    with pytest.raises(ValidationError):
        chat(messages=[])


def test_include_usage_only_when_streaming() -> None:
    opts = {"include_usage": True}
    assert chat(stream=True, stream_options=opts).include_usage() is True
    assert chat(stream=False, stream_options=opts).include_usage() is False
    assert chat(stream=True).include_usage() is False
    assert chat(stream=True, stream_options={"include_usage": False}).include_usage() is False
    assert completion(stream=True, stream_options=opts).include_usage() is True


def test_prompt_as_a_string_or_a_list_of_one() -> None:
    assert completion(prompt="Once").prompt_text() == "Once"
    assert completion(prompt=["Once"]).prompt_text() == "Once"


def test_a_list_of_two_prompts_is_refused() -> None:
    req = completion(prompt=["a", "b"])
    with pytest.raises(InvalidRequest) as info:
        req.prompt_text()
    assert info.value.status == 400 and info.value.param == "prompt"


def test_an_empty_prompt_list_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        completion(prompt=[]).prompt_text()


def test_echo_is_refused() -> None:
    with pytest.raises(InvalidRequest) as info:
        completion(echo=True).token_budget()
    assert info.value.param == "echo" and info.value.status == 400


def test_completion_token_budget_defaults_to_sixteen() -> None:
    assert completion().token_budget() == 16
    assert completion(max_tokens=5).token_budget() == 5


def test_chat_token_budget_prefers_max_completion_tokens() -> None:
    assert chat().token_budget() is None
    assert chat(max_tokens=10).token_budget() == 10
    assert chat(max_tokens=10, max_completion_tokens=20).token_budget() == 20


def test_max_tokens_below_one_is_refused() -> None:
    assert chat(max_tokens=1).token_budget() == 1
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(ValidationError):
            chat(**{field: 0})
    with pytest.raises(ValidationError):
        completion(max_tokens=0)


@pytest.mark.parametrize("t", [0.0, 1.0, 2.0])
def test_temperature_within_bounds(t: float) -> None:
    assert chat(temperature=t).temperature == t


@pytest.mark.parametrize("t", [-0.1, 2.01])
def test_temperature_out_of_bounds(t: float) -> None:
    with pytest.raises(ValidationError) as info:
        chat(temperature=t)
    assert error_locs(info.value) == {"temperature"}


@pytest.mark.parametrize("p", [0.0, 1.5])
def test_top_p_out_of_bounds(p: float) -> None:
    with pytest.raises(ValidationError):
        chat(top_p=p)


def test_an_empty_model_is_refused() -> None:
    with pytest.raises(ValidationError):
        chat(model="")


def test_unknown_fields_are_ignored() -> None:
    assert chat(vendor_extension={"x": 1}).model == "smollm2"


# -- strict types -----------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("stream", "yes"), ("stream", 1), ("temperature", "0.5"), ("temperature", True),
    ("max_tokens", 1.5), ("max_tokens", "5"), ("max_tokens", True), ("seed", 1.0),
    ("seed", "7"), ("model", 5), ("stop", 3), ("user", 1), ("n", "1"),
    ("stream_options", {"include_usage": "yes"}), ("messages", {"role": "user"}),
])
def test_values_of_the_wrong_type_are_refused_not_coerced(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**{field: value})
    assert error_locs(info.value) == {field}


def test_integers_are_numbers_too() -> None:
    assert chat(temperature=1, top_p=1, presence_penalty=0).temperature == 1.0


def test_nulls_mean_the_default() -> None:
    body = chat(stream=None, n=None, presence_penalty=None, frequency_penalty=None,
                temperature=None, stop=None, seed=None)
    assert body.stream is None and body.penalties() == (0.0, 0.0)
    assert completion(max_tokens=None).token_budget() == 16


# -- what the event schema and the engine can hold ----------------------------

def test_seed_spans_a_signed_64_bit_long() -> None:
    assert chat(seed=2**63 - 1).seed == 2**63 - 1
    assert chat(seed=-(2**63)).seed == -(2**63)
    for seed in (2**63, -(2**63) - 1, 10**30):
        with pytest.raises(ValidationError) as info:
            chat(seed=seed)
        assert error_locs(info.value) == {"seed"}


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_token_budgets_fit_a_32_bit_int(field: str) -> None:
    assert getattr(chat(**{field: 2**31 - 1}), field) == 2**31 - 1
    with pytest.raises(ValidationError) as info:
        chat(**{field: 2**31})
    assert error_locs(info.value) == {field}
    with pytest.raises(ValidationError):
        completion(max_tokens=2**31)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_numbers_are_refused(value: float) -> None:
    with pytest.raises(ValidationError):
        chat(temperature=value)
    with pytest.raises(ValidationError):
        chat(presence_penalty=value)


LONE = "a\ud800b"


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": LONE}]},
    {"messages": [{"role": LONE, "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi", "name": LONE}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
    {"stop": LONE}, {"stop": ["x", LONE]}, {"model": LONE}, {"user": LONE},
    {"metadata": {"k": LONE}},
])
def test_a_lone_surrogate_in_any_string_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**body)
    assert error_locs(info.value) == set(body)
    assert {e["type"] for e in info.value.errors()} & {"value_error", "string_unicode"}


def test_a_lone_surrogate_in_a_prompt_is_refused() -> None:
    for prompt in (LONE, [LONE]):
        with pytest.raises(ValidationError) as info:
            completion(prompt=prompt)
        assert error_locs(info.value) == {"prompt"}


def test_text_beyond_the_basic_plane_is_fine() -> None:
    assert chat(messages=[{"role": "user", "content": "\U0001f600 \u00e9"}]).messages[0].text() \
        == "\U0001f600 \u00e9"


def test_an_empty_prompt_is_accepted_as_openai_accepts_it() -> None:
    assert completion(prompt="").prompt_text() == ""


# -- what Conveyor does not serve is refused, what is harmless passes -----------

@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("top_logprobs", 2), ("top_logprobs", 21),
    ("audio", {"voice": "alloy"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "high"), ("web_search_options", {}),
])
def test_unsupported_chat_parameters_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**{field: value})
    assert error_locs(info.value) == {field}


@pytest.mark.parametrize(("field", "value"), [
    ("logprobs", 6), ("suffix", "end"), ("best_of", 3),
    ("store", True),
])
def test_unsupported_completion_parameters_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        completion(**{field: value})
    assert error_locs(info.value) == {field}


def test_a_chat_completion_may_be_stored_with_its_metadata() -> None:
    from schemas.openai.generations import chat_generation

    generation = chat_generation(chat(store=True, metadata={"run": "nightly"}))
    assert generation["store"] and generation["metadata"] == {"run": "nightly"}
    assert generation["api"] == "chat.completions"
    assert not chat_generation(chat())["store"]


@pytest.mark.parametrize("metadata", [
    {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}])
def test_metadata_past_openais_limits_is_refused(metadata: dict[str, str]) -> None:
    with pytest.raises(ValidationError) as info:
        chat(store=True, metadata=metadata)
    assert error_locs(info.value) == {"metadata"}


def test_parameters_that_ask_for_nothing_pass() -> None:
    body = chat(tools=[], tool_choice="none", logprobs=False, logit_bias={},
                response_format={"type": "text"}, store=False, modalities=["text"],
                user="u1", metadata={"k": "v"}, service_tier="auto",
                stream_options={"include_usage": True})
    assert body.model == "smollm2"
    assert completion(logprobs=0, suffix="", best_of=1, echo=False).token_budget() == 16


def test_logit_bias_maps_token_ids_to_a_bias() -> None:
    from schemas.openai.generations import chat_generation, completion_generation

    assert chat_generation(chat(logit_bias={"42": -100, "7": 2.5}))["sampling"][
        "logit_bias"] == {"42": -100.0, "7": 2.5}
    assert completion(logit_bias={"0042": 1})  # the id is normalised
    assert completion_generation(completion(logit_bias={"0042": 1}))["sampling"][
        "logit_bias"] == {"42": 1.0}
    assert chat_generation(chat(logit_bias={}))["sampling"]["logit_bias"] == {}


@pytest.mark.parametrize("bias", [{"a": 1}, {"-1": 1}, {"1.5": 1}, {"1": 101}, {"1": -100.5},
                                  {"1": "x"}, {str(i): 1 for i in range(301)},
                                  {str(2**31): 1}])
def test_a_logit_bias_openai_would_refuse_is_refused(bias: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        chat(logit_bias=bias)
    assert error_locs(info.value) == {"logit_bias"}
