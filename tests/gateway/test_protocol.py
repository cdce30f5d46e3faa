"""The OpenAI request models at the edge: what is accepted, normalised or refused."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.errors import InvalidRequest
from gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


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


@pytest.mark.parametrize("n", [0, 2, 5])
def test_only_one_choice_is_served(n: int) -> None:
    with pytest.raises(ValidationError) as info:
        chat(n=n)
    assert error_locs(info.value) == {"n"}
    with pytest.raises(ValidationError):
        completion(n=n)


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


def test_non_text_content_parts_are_refused() -> None:
    with pytest.raises(ValidationError):
        ChatMessage.model_validate({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]})


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
    assert chat(logit_bias={"1": 2}).model == "smollm2"
