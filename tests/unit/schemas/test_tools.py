"""Tool calls (schemas/tools.py, schemas/tool_calls.py): the API's checks, the
prompt's turns, the grammar, and the reader that turns an answer's text into
OpenAI's calls."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.errors import InvalidRequest
from schemas.answer_format import grammar_of, violation
from schemas.openai.chunks import full_response
from schemas.openai.generations import chat_generation
from schemas.openai.requests import ChatCompletionRequest
from schemas.records import Message, Tools
from schemas.tool_calls import ToolCallReader, call_id, read_tool_calls
from schemas.tools import tool_format, tool_messages, tools_violation

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1}},
        "required": ["city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            **fields}
    return ChatCompletionRequest.model_validate(body)


def tools_of(**fields: Any) -> Tools:
    tools = chat(**{"tools": [WEATHER, NOW], **fields}).tools_record()
    assert tools is not None
    return tools


# -- the API --------------------------------------------------------------------------


def test_tools_travel_checked_in_the_generation() -> None:
    g = chat_generation(chat(tools=[WEATHER, NOW], tool_choice="required",
                             parallel_tool_calls=False))
    tools = g["tools"]
    assert tools is not None
    assert [f["name"] for f in tools["functions"]] == ["get_weather", "now"]
    assert tools["choice"] == "required" and tools["parallel"] is False
    assert json.loads(tools["functions"][0]["parameters"])["required"] == ["city"]
    assert tools["functions"][0]["strict"] and tools["functions"][1]["parameters"] == ""
    named = chat_generation(chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))["tools"]
    assert named is not None and (named["choice"], named["function"]) == (
        "function", "get_weather")
    assert chat_generation(chat())["tools"] is None


# tools that cannot be served, and the parameter their 400 names (HTTP: tests/faults/test_tools.py)
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters"),
    ({"tools": [NOW, NOW]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_tools_that_cannot_be_served_are_a_400_naming_the_parameter(
        fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        chat_generation(chat(**fields))
    assert info.value.param == param


@pytest.mark.parametrize(("fields", "loc"), [
    ({"tool_choice": "auto"}, "tool_choice"),  # tool_choice without tools
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages"),
])
def test_malformed_tools_are_refused_by_the_model(fields: dict[str, Any],
                                                  loc: str | None) -> None:
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    if loc is not None:
        assert info.value.errors()[0]["loc"][0] == loc


def test_a_history_with_calls_and_their_results_is_accepted() -> None:
    g = chat_generation(chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]))
    assert g["messages"][1]["tool_calls"] == [
        {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert g["messages"][2]["tool_call_id"] == "call_1"


# -- the prompt -------------------------------------------------------------------------


def turn(role: str, content: str, **fields: Any) -> Message:
    return Message(role=role, content=content, name=None,
                   tool_calls=fields.get("tool_calls"), tool_call_id=fields.get("tool_call_id"),
                   images=None)


def test_the_tools_and_the_calls_are_written_as_plain_turns() -> None:
    messages = [turn("system", "Be brief."), turn("user", "Weather in Paris and Rome?"),
                turn("assistant", "", tool_calls=[
                    {"id": "a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                    {"id": "b", "name": "get_weather", "arguments": '{"city": "Rome"}'}]),
                turn("tool", "18 C", tool_call_id="a"), turn("tool", "21 C", tool_call_id="b")]
    out = tool_messages(messages, tools_of())
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    assert out[3]["content"] == ("<tool_response>\n18 C\n</tool_response>\n"
                                 "<tool_response>\n21 C\n</tool_response>")
    assert all(m["tool_calls"] is None and m["tool_call_id"] is None and m["name"] is None
               for m in out)


def test_without_a_system_prompt_one_holds_the_tools_and_none_shows_none() -> None:
    out = tool_messages([turn("user", "hi")], tools_of(tool_choice="required"))
    assert out[0]["role"] == "system" and "You must call at least one function." in \
        out[0]["content"]
    assert tool_messages([turn("user", "hi")], tools_of(tool_choice="none")) == [
        turn("user", "hi")]


def test_a_user_turn_s_images_stay_where_they_stood_among_the_plain_turns() -> None:
    image = {"file_id": "file-" + "a" * 24, "media_type": "image/png", "bytes": 10,
             "sha256": "a" * 64, "width": 1, "height": 1, "offset": 5,
             "part": "messages[0].content[1]"}
    seeing: Message = {**turn("user", "This: what is it?"), "images": [image]}  # type: ignore[typeddict-item]
    out = tool_messages([seeing], tools_of(tool_choice="auto"))
    assert [m["role"] for m in out] == ["system", "user"]
    assert out[1]["content"] == "This: what is it?" and out[1]["images"] == [image]


# -- the grammar -------------------------------------------------------------------------


def test_the_grammar_holds_calls_to_the_functions_allowed() -> None:
    from llama_cpp import LlamaGrammar

    for choice in ("auto", "required", {"type": "function", "function": {"name": "now"}}):
        for parallel in (True, False):
            fmt = tool_format(tools_of(tool_choice=choice, parallel_tool_calls=parallel))
            grammar = grammar_of(fmt)
            LlamaGrammar.from_string(grammar, verbose=False)  # llama.cpp parses it
            assert ('"{\\"name\\": \\"get_weather\\"' in grammar) == (choice != {
                "type": "function", "function": {"name": "now"}})
            assert ("{0,7}" in grammar) == parallel
            assert ("| \"\"" in grammar) == (choice == "auto")


# -- reading the answer -------------------------------------------------------------------

ANSWER = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r\\"is", '
          '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n'
          '</tool_call>\n')


def test_an_answer_of_calls_reads_as_openai_calls() -> None:
    read = read_tool_calls("r1", ANSWER)
    assert read.content is None and not read.broken
    assert read.tool_calls == [
        {"id": call_id("r1", 0), "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Pa}r\\"is", "unit": "c"}'}},
        {"id": call_id("r1", 1), "type": "function", "function": {
            "name": "now", "arguments": "{}"}}]
    assert call_id("r1", 0) != call_id("r1", 1) != call_id("r2", 1)
    assert call_id("r1", 0).startswith("call_")


def test_text_is_content_and_a_tag_split_across_chunks_is_held() -> None:
    reader = ToolCallReader("r")
    assert [e.text for e in reader.feed("It is <tool")] == ["It is "]
    assert reader.feed("bar> ok") and reader.finish() == []
    read = read_tool_calls("r", "Hello <b>world</b>")
    assert read.content == "Hello <b>world</b>" and read.tool_calls == []
    assert read_tool_calls("r", "ends with <tool_c").content == "ends with <tool_c"


def test_a_stream_read_in_any_pieces_is_the_whole_answer() -> None:
    text = "Let me look.\n" + ANSWER
    whole = read_tool_calls("r", text)
    rng = random.Random(7)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
        reader, events, at = ToolCallReader("r"), [], 0
        for cut in [*cuts, len(text)]:
            events += reader.feed(text[at:cut])
            at = cut
        events += reader.finish()
        assert "".join(e.text for e in events if e.kind == "content") == whole.content
        starts = [(e.id, e.name) for e in events if e.kind == "call"]
        assert starts == [(c["id"], c["function"]["name"]) for c in whole.tool_calls]
        for i, call in enumerate(whole.tool_calls):
            assert "".join(e.text for e in events if e.kind == "arguments" and e.index == i) \
                == call["function"]["arguments"]


def test_a_call_cut_short_keeps_what_it_read() -> None:
    read = read_tool_calls("r", '<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert read.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    broken = read_tool_calls("r", "<tool_call>\nnot json\n</tool_call>")
    assert broken.tool_calls == [] and broken.broken


def test_the_whole_answer_carries_its_calls_and_finishes_with_tool_calls() -> None:
    body = full_response("chat", "m", 1, "r1", ANSWER, "stop", None, tool_calls=True)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
        "get_weather", "now"]
    plain = full_response("chat", "m", 1, "r1", "Hi.", "stop", None, tool_calls=True)
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Hi."}
    assert plain["choices"][0]["finish_reason"] == "stop"
    cut = full_response("chat", "m", 1, "r1", ANSWER[:40], "length", None, tool_calls=True)
    assert cut["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("choice", "text", "wrong"), [
    ("auto", ANSWER, None),
    ("auto", "No call needed.", None),
    ("required", "No call needed.", "calls no function"),
    ("auto", '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>', "may not call"),
    ("auto", '<tool_call>\n{"name": "get_weather", "arguments": {"days": 0, "city": "P"}}\n'
             '</tool_call>', "minimum"),
    ("auto", '<tool_call>\n{"name": "now", "arguments": [1]}\n</tool_call>', "not a JSON object"),
    ("auto", "<tool_call>\nnope\n</tool_call>", "not a JSON object with a name"),
    ({"type": "function", "function": {"name": "now"}}, ANSWER, "may not call"),
])
def test_the_answer_is_checked_against_the_tools(choice: Any, text: str,
                                                 wrong: str | None) -> None:
    fmt = tool_format(tools_of(tool_choice=choice))
    found = tools_violation(fmt, text)
    assert found == wrong if wrong is None else wrong in (found or "")
    assert violation(fmt, text) == found


def test_a_call_nested_past_the_json_parser_is_not_a_call_and_no_crash() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    read = read_tool_calls("r", f'<tool_call>{{"arguments": {deep}, "name": "x"}}</tool_call>')
    assert read.tool_calls == []
