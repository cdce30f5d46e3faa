"""Tool calls: what a chat request's ``tools`` ask of the answer. The functions
are shown in the system prompt (:func:`tool_messages`) and the model calls one
with a ``<tool_call>`` block of ``{"name", "arguments"}``; checked at the API
(:func:`check_tools`), held by a grammar in the engines (:func:`tools_grammar`)
and checked once answered (:func:`tools_violation`). The calls are read from
the text by schemas/tool_calls.py. Why: docs/decisions/0019-tool-calls-as-text.md.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from conveyor.errors import InvalidRequest
from schemas.records import Function, Generation, Message, ResponseFormat, ToolCall, Tools
from schemas.structured import _json_strings, _schema_fault, grammar_fault, schema_converter
from schemas.tool_calls import CLOSE, OPEN, read_tool_calls

__all__ = ["check_tools", "tools_of", "reads_tool_calls", "tool_format", "tool_messages",
           "tools_grammar", "tools_violation", "MAX_TOOLS"]

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# OpenAI's bound on the functions of one request
MAX_TOOLS = 128
# calls one answer may make when parallel calls are allowed
MAX_PARALLEL_CALLS = 8
_GRAMMARS_KEPT = 128


def reads_tool_calls(generation: Generation) -> bool:
    """Whether the answer is read for tool calls: tools given, and the choice
    is not ``none``."""
    tools = generation.get("tools")
    return bool(tools and tools["functions"] and tools["choice"] != "none")


def tool_format(tools: Tools) -> ResponseFormat:
    """The tools as the format an engine decodes within (its ``type`` is
    ``tool_calls``; its ``schema`` the tools' canonical JSON, the key of the
    compiled grammar)."""
    return ResponseFormat(type="tool_calls", name="", schema=_canonical(tools), strict=False)


def _canonical(tools: Tools) -> str:
    return json.dumps({"functions": tools["functions"], "choice": tools["choice"],
                       "function": tools["function"], "parallel": tools["parallel"]},
                      sort_keys=True, separators=(",", ":"))


# -- the API's checks ---------------------------------------------------------


def tools_of(functions: list[Function], choice: str | None, named: str | None,
             parallel: bool | None, format_type: str | None, format_param: str,
             function_param: str = "tools[{}].function") -> Tools | None:
    """The tools of a request as the pipeline carries them, checked (each fault
    an :class:`InvalidRequest` naming its parameter); None without functions.
    ``named`` is the function a named ``tool_choice`` gives, ``format_type``
    the answer's format (``format_param`` names it), which calls exclude."""
    if not functions:
        return None
    tools = Tools(functions=functions,
                  choice="function" if named else choice or "auto",  # type: ignore[typeddict-item]
                  function=named or "", parallel=parallel is not False)
    if tools["choice"] != "none":
        if format_type not in (None, "text"):
            raise InvalidRequest(f"{format_param} cannot be combined with tools here: leave "
                                 "one out, or set tool_choice to 'none'.", param=format_param)
        check_tools(tools, function_param)
    return tools


def check_tools(tools: Tools, function_param: str = "tools[{}].function") -> None:
    """Raise :class:`InvalidRequest` naming the parameter at fault;
    ``function_param`` is where the i-th function is (chat nests it in
    ``function``, the Responses API does not)."""
    names = [f["name"] for f in tools["functions"]]
    for i, function in enumerate(tools["functions"]):
        if names.index(function["name"]) != i:
            raise InvalidRequest(f"Duplicate function name {function['name']!r} in tools.",
                                 param=function_param.format(i) + ".name")
        if function["parameters"]:
            wrong = _schema_fault(function["parameters"])
            if wrong is not None:
                raise InvalidRequest(
                    f"Invalid parameters schema for function {function['name']!r}: {wrong}",
                    param=function_param.format(i) + ".parameters")
            params = json.loads(function["parameters"])
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise InvalidRequest(
                    f"The parameters of function {function['name']!r} must be a JSON Schema "
                    "of type 'object'.", param=function_param.format(i) + ".parameters")
    if tools["choice"] == "function" and tools["function"] not in names:
        raise InvalidRequest(
            f"tool_choice names the function {tools['function']!r}, which is not in tools.",
            param="tool_choice")
    try:
        wrong = grammar_fault(_grammar(_canonical(tools)))
    except ValueError as exc:
        wrong = str(exc)
    if wrong is not None:
        raise InvalidRequest(f"The tools cannot be compiled to a grammar: {wrong}",
                             param="tools")


# -- the prompt ----------------------------------------------------------------


def tool_messages(messages: list[Message], tools: Tools | None) -> list[Message]:
    """The conversation as plain turns a chat template renders: the functions
    described in the system prompt (unless the choice is ``none``), an
    assistant turn's calls as ``<tool_call>`` blocks, and each run of ``tool``
    messages as one user turn of ``<tool_response>`` blocks."""
    out: list[Message] = []
    for message in messages:
        calls = message.get("tool_calls") or []
        if message["role"] == "tool":
            block = f"{RESPONSE_OPEN}\n{message['content']}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("name") == _TOOL_TURN:
                out[-1] = _turn(role="user", content=out[-1]["content"] + "\n" + block,
                                  name=_TOOL_TURN)
            else:
                out.append(_turn(role="user", content=block, name=_TOOL_TURN))
            continue
        if calls:
            text = "\n".join(_call_block(c) for c in calls)
            content = f"{message['content']}\n{text}" if message["content"] else text
            out.append(_turn(role="assistant", content=content, name=message.get("name")))
            continue
        # a user turn's images stay where they stood in its text, unchanged
        out.append({**_turn(role=message["role"], content=message["content"],
                            name=message.get("name")), "images": message.get("images")})
    for m in out:
        if m.get("name") == _TOOL_TURN:
            m["name"] = None
    if tools and tools["functions"] and tools["choice"] != "none":
        preamble = _preamble(tools)
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]
            out[0] = _turn(role=first["role"], content=f"{first['content']}\n\n{preamble}",
                             name=first.get("name"))
        else:
            out.insert(0, _turn(role="system", content=preamble, name=None))
    return out


_TOOL_TURN = "\x00tool-responses"  # marks a turn of tool responses while merging


def _turn(role: str, content: str, name: str | None) -> Message:
    """A plain turn, every field of the record set (as the codec reads it back)."""
    return Message(role=role, content=content, name=name, tool_calls=None, tool_call_id=None,
                   images=None)


def _call_block(call: ToolCall) -> str:
    try:
        arguments: Any = json.loads(call["arguments"]) if call["arguments"].strip() else {}
    except ValueError:
        arguments = call["arguments"]
    body = json.dumps({"name": call["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _preamble(tools: Tools) -> str:
    lines = []
    for function in tools["functions"]:
        spec: dict[str, Any] = {"name": function["name"]}
        if function["description"]:
            spec["description"] = function["description"]
        spec["parameters"] = json.loads(function["parameters"]) if function["parameters"] \
            else {"type": "object", "properties": {}}
        lines.append(json.dumps({"type": "function", "function": spec}, ensure_ascii=False))
    must = {
        "auto": "Call a function when it helps; otherwise answer in plain text.",
        "required": "You must call at least one function.",
        "function": f"You must call the function {tools['function']}.",
    }[tools["choice"]]
    return ("# Tools\n\nYou can call these functions, described in JSON between the "
            "<tools></tools> tags:\n<tools>\n" + "\n".join(lines) + "\n</tools>\n\n"
            "To call a function, answer with a JSON object of its name and arguments "
            "between <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
            "</tool_call>\nEach result comes back between <tool_response></tool_response> "
            f"tags. {must}")


# -- the grammar -------------------------------------------------------------------


def tools_grammar(fmt: ResponseFormat) -> str:
    """The GBNF grammar of a ``tool_calls`` format (see :func:`tool_format`)."""
    return _grammar(fmt["schema"])


def _gbnf_literal(text: str) -> str:
    return json.dumps(text)  # GBNF's string literals escape as JSON's do


@lru_cache(maxsize=_GRAMMARS_KEPT)
def _grammar(tools_text: str) -> str:
    tools = json.loads(tools_text)
    functions = tools["functions"]
    if tools["choice"] == "function":
        functions = [f for f in functions if f["name"] == tools["function"]]
    converter = schema_converter()
    calls = []
    for i, function in enumerate(functions):
        params = json.loads(function["parameters"]) if function["parameters"] \
            else {"type": "object", "properties": {}}
        try:
            params = converter.resolve_refs(params, f"tools{i}")
            args = converter.visit(params, f"tool{i}-arguments")
        except Exception as exc:  # the compiler's asserts, lookups, recursion: the schema's
            message = str(exc) or type(exc).__name__
            raise ValueError(f"function {function['name']!r}: {message}") from None
        head = _gbnf_literal('{"name": "' + function["name"] + '", "arguments": ')
        calls.append(f"{head} {args} \"}}\"")
    rules = str(converter.format_grammar())
    block = f"{_gbnf_literal(OPEN + chr(10))} call {_gbnf_literal(chr(10) + CLOSE)}"
    repeat = f"(\"\\n\" block){{0,{MAX_PARALLEL_CALLS - 1}}}" if tools["parallel"] else ""
    own = [f"call ::= {' | '.join(calls)}", f"block ::= {block}", f"calls ::= block {repeat}"]
    if tools["choice"] == "auto":
        # text that does not open a call: its first character is not "<" or space
        own.append("tool-root ::= calls | [^<\\x09\\x0A\\x0D ] [\\x01-\\U0010FFFF]* | \"\"")
    else:
        own.append("tool-root ::= calls")
    return _json_strings(rules).rstrip("\n") + "\n" + \
        "\n".join(own).replace("tool-root", "root") + "\n"


def tools_violation(fmt: ResponseFormat, text: str) -> str | None:
    """What is wrong with an answer's calls, or None: each names a function
    given (the one ``tool_choice`` names), its arguments are a JSON object,
    valid against the function's parameters when it is ``strict``; a
    ``required`` choice made at least one call."""
    tools = json.loads(fmt["schema"])
    try:
        read = read_tool_calls("check", text)
    except RecursionError:
        return "a tool call is nested too deeply to read"
    if read.broken:
        return f"a tool call is not a JSON object with a name and arguments: {read.broken[0]!r}"
    functions = {f["name"]: f for f in tools["functions"]}
    if tools["choice"] in ("required", "function") and not read.tool_calls:
        return "the answer calls no function, and tool_choice requires one"
    for call in read.tool_calls:
        name = call["function"]["name"]
        function = functions.get(name)
        if function is None or (tools["choice"] == "function" and name != tools["function"]):
            return f"the answer calls the function {name!r}, which it may not call"
        try:
            arguments = json.loads(call["function"]["arguments"])
        except RecursionError:
            return f"the arguments of the call of {name!r} are nested too deeply to read"
        except ValueError as exc:
            return f"the arguments of the call of {name!r} are not JSON: {exc}"
        if not isinstance(arguments, dict):
            return f"the arguments of the call of {name!r} are not a JSON object"
        if function["strict"] and function["parameters"]:
            from jsonschema import Draft202012Validator

            validator = Draft202012Validator(json.loads(function["parameters"]))
            try:
                error = next(iter(validator.iter_errors(arguments)), None)
            except RecursionError:
                return (f"the arguments of the call of {name!r} are nested too deeply to "
                        "check against its parameters")
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "(the root)"
                return (f"the arguments of the call of {name!r} do not match its "
                        f"parameters at {where}: {error.message}")
    return None
