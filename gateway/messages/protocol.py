"""Anthropic's Messages API request (``POST /v1/messages``) as a chat generation.

The top-level fields are a strict pydantic model; content blocks are read by
hand, so a refusal names the block (``messages.0.content.1``) as Anthropic's
errors do. What the pipeline cannot honour is a 400 naming it, never ignored:
image and document blocks (images are not served on this text lane), a final
assistant turn to continue (a prefill), ``top_k``
(no engine's sampling carries it), server tools, extended thinking. The whole
list: docs/api/messages.md.

Each pipeline message remembers the Anthropic path it came from
(:attr:`Mapped.origins`), so an error the pipeline raises about
``messages[k]`` names the request's own field (:func:`anthropic_param`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conveyor.errors import InvalidRequest, RequestError
from schemas.openai.fields import Text, json_object
from schemas.openai.requests import MAX_INT32, invalid_request, model_field_names, param_of
from schemas.records import Function, Generation, Message, Sampling, ToolCall, Tools
from schemas.tools import MAX_TOOLS, tools_of

__all__ = ["MessagesRequest", "Mapped", "parse_request", "generation_of", "anthropic_param",
           "translated", "tool_use_id"]

# what a tool's name may hold (Anthropic's rule)
_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
# fields of Anthropic's API that Conveyor knows and refuses, with why
_REFUSED = {
    "thinking": "extended thinking is not supported by this server",
    "top_k": "top_k is not supported: no engine behind Conveyor's pipeline samples by it",
    "container": "containers (server-side tools) are not supported by this server",
    "mcp_servers": "MCP servers are not supported by this server",
    "context_management": "context management is not supported by this server",
    "output_config": "output_config (effort, a JSON output format) is not supported by "
                     "this server's Messages API",
}


class SystemText(BaseModel):
    """A ``system`` text block (``cache_control`` and ``citations`` accepted, without effect)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["user", "assistant"]
    content: Text | list[dict[str, Any]]


class UserMetadata(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    user_id: Text | None = Field(default=None, max_length=256)


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/messages``."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: Text = Field(min_length=1)
    max_tokens: int = Field(ge=1, le=MAX_INT32)
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[SystemText] | None = None
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = None
    metadata: UserMetadata | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = None
    # accepted and without effect here: one tier, speed and place serve every
    # request; the prefix cache needs no marks; nothing is billed to a workspace
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: Text | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: Text | None = None
    workspace_id: Text | None = None
    output_config: Any = None
    thinking: Any = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None


_NAMES = model_field_names(MessagesRequest, InputMessage, SystemText, UserMetadata)


def parse_request(raw: bytes) -> MessagesRequest:
    """The validated body; every refusal an :class:`InvalidRequest` (400) naming its
    field as Anthropic does (``messages.0.role``)."""
    data = json_object(raw)
    for name, why in _REFUSED.items():
        if data.get(name) is not None:
            raise InvalidRequest(f"{name}: {why}.", param=name)
    try:
        return MessagesRequest.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        extra = next((e for e in errors if e["type"] == "extra_forbidden"), None)
        if extra is not None:
            loc = extra["loc"]  # its last part is the field given, none of _NAMES
            where = anthropic_param(param_of(loc, _NAMES | {str(loc[-1])}), None)
            raise InvalidRequest(f"{where}: Extra inputs are not permitted",
                                 param=where) from None
        error = invalid_request(errors, _NAMES)
        param = anthropic_param(error.param, None)
        message = error.message
        if error.param:
            message = message.removesuffix(f" ({error.param})")
        raise InvalidRequest(f"{param}: {message}" if param else message, param=param) from None


@dataclass
class Mapped:
    """A request as the pipeline's chat generation, with where each of its messages
    came from (``system``, ``messages.3``)."""

    generation: Generation
    origins: list[str]


def generation_of(body: MessagesRequest) -> Mapped:
    """The chat generation a Messages request asks for (see the module)."""
    messages: list[Message] = []
    origins: list[str] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else \
            "\n\n".join(block.text for block in body.system)
        if system:
            messages.append(_message("system", system))
            origins.append("system")
    last = len(body.messages) - 1
    if body.messages[last].role == "assistant":
        raise InvalidRequest(
            f"messages.{last}: a final assistant message (a prefill for the answer to "
            "continue) is not supported here: the pipeline answers with a turn of its own.",
            param=f"messages.{last}")
    for i, message in enumerate(body.messages):
        for turn in _turns(i, message):
            messages.append(turn)
            origins.append(f"messages.{i}")
    sampling = Sampling(temperature=1.0 if body.temperature is None else body.temperature,
                        top_p=1.0 if body.top_p is None else body.top_p,
                        max_tokens=body.max_tokens, stop=list(body.stop_sequences or []),
                        seed=None, presence_penalty=0.0, frequency_penalty=0.0, logit_bias={},
                        logprobs=False, top_logprobs=0)
    metadata = {"user_id": body.metadata.user_id} \
        if body.metadata is not None and body.metadata.user_id else {}
    generation = Generation(kind="chat", model=body.model, messages=messages, prompt=None,
                            sampling=sampling, stream=bool(body.stream), include_usage=False,
                            created=int(time.time()), store=False, metadata=metadata,
                            api="messages", response_format=None, tools=_tools(body))
    return Mapped(generation, origins)


def tool_use_id(call_id: str) -> str:
    """A pipeline tool call's id as Anthropic's ``toolu_`` id (the same call, the
    same id, however often the answer is read)."""
    return "toolu_" + call_id.removeprefix("call_")


def _message(role: str, content: str, tool_calls: list[ToolCall] | None = None,
             tool_call_id: str | None = None) -> Message:
    return Message(role=role, content=content, name=None, tool_calls=tool_calls,
                   tool_call_id=tool_call_id, images=None)


def _turns(i: int, message: InputMessage) -> list[Message]:
    """One Anthropic message as the pipeline's turns: a user message's
    ``tool_result`` blocks become ``tool`` turns (in their place), an assistant
    message's ``tool_use`` blocks its calls."""
    if isinstance(message.content, str):
        return [_message(message.role, message.content)]
    texts: list[str] = []
    calls: list[ToolCall] = []
    out: list[Message] = []
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use" and message.role == "assistant":  # (a client's own call)
            calls.append(_call(block, where))
        elif kind == "tool_result" and message.role == "user":
            if texts:
                out.append(_message("user", "\n".join(texts)))
                texts = []
            out.append(_result(block, where))
        elif kind in ("tool_use", "tool_result"):
            raise InvalidRequest(f"{where}: a {kind} block belongs in an "
                                 f"{'assistant' if kind == 'tool_use' else 'user'} message.",
                                 param=where)
        elif kind in ("image", "document"):
            raise InvalidRequest(
                f"{where}: {kind} content blocks are not supported: this server's "
                "Messages API takes text, tool_use and tool_result blocks.", param=where)
        else:
            raise InvalidRequest(f"{where}.type: unsupported content block type {kind!r}; "
                                 "supported: text, tool_use, tool_result.",
                                 param=f"{where}.type")
    if texts or calls or not out:
        out.append(_message(message.role, "\n".join(texts), tool_calls=calls or None))
    return out


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text: Field required (a string)", param=f"{where}.text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{where}.text: must be valid Unicode text; it holds a lone "
                             "surrogate", param=f"{where}.text") from None
    _no_extra(block, where, {"type", "text", "cache_control", "citations"})
    return text


def _tool_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not re.match(_TOOL_NAME, name):
        raise InvalidRequest(f"{where}.name: a tool's name of 1 to 128 letters, digits, _ "
                             "or -", param=f"{where}.name")
    return name


def _call(block: dict[str, Any], where: str) -> ToolCall:
    _no_extra(block, where, {"type", "id", "name", "input", "cache_control", "caller",
                             "toolset_name"})
    id_, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(id_, str) or not id_:
        raise InvalidRequest(f"{where}.id: Field required (a string)", param=f"{where}.id")
    name = _tool_name(name, where)
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.input: must be an object", param=f"{where}.input")
    return ToolCall(id=id_, name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _result(block: dict[str, Any], where: str) -> Message:
    _no_extra(block, where, {"type", "tool_use_id", "content", "is_error", "cache_control",
                             "toolset_name"})
    id_, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(id_, str) or not id_:
        raise InvalidRequest(f"{where}.tool_use_id: Field required (a string)",
                             param=f"{where}.tool_use_id")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            inner = f"{where}.content.{k}"
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"{inner}: a tool_result's content holds text blocks "
                                     f"only here, not {kind!r}.", param=inner)
            parts.append(_text(part, inner))
        text = "\n".join(parts)
    else:
        raise InvalidRequest(f"{where}.content: a string or a list of text blocks",
                             param=f"{where}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return _message("tool", text, tool_call_id=id_)


def _no_extra(block: dict[str, Any], where: str, allowed: set[str]) -> None:
    extra = sorted(set(block) - allowed)
    if extra:
        raise InvalidRequest(f"{where}.{extra[0]}: Extra inputs are not permitted",
                             param=f"{where}.{extra[0]}")


def _tools(body: MessagesRequest) -> Tools | None:
    """``tools`` and ``tool_choice`` as the pipeline's tools (decision 0019)."""
    functions: list[Function] = []
    for i, tool in enumerate(body.tools or ()):
        where = f"tools.{i}"
        if tool.get("type") not in (None, "custom"):
            raise InvalidRequest(f"{where}.type: server tools ({tool.get('type')!r}) are not "
                                 "supported; give client tools with name and input_schema.",
                                 param=f"{where}.type")
        # strict is honoured; the rest shape nothing the pipeline does
        _no_extra(tool, where, {"type", "name", "description", "input_schema", "strict",
                                "cache_control", "eager_input_streaming", "input_examples",
                                "allowed_callers", "defer_loading"})
        if tool.get("allowed_callers") not in (None, ["direct"]):
            raise InvalidRequest(f"{where}.allowed_callers: only 'direct' callers are "
                                 "supported here.", param=f"{where}.allowed_callers")
        if tool.get("defer_loading"):
            raise InvalidRequest(f"{where}.defer_loading: tool search is not supported "
                                 "here.", param=f"{where}.defer_loading")
        name, schema = tool.get("name"), tool.get("input_schema")
        description = tool.get("description") or ""
        name = _tool_name(name, where)
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{where}.input_schema: Field required (a JSON Schema "
                                 "object)", param=f"{where}.input_schema")
        if not isinstance(description, str):
            raise InvalidRequest(f"{where}.description: must be a string",
                                 param=f"{where}.description")
        functions.append(Function(name=name, description=description,
                                  parameters=json.dumps(schema, ensure_ascii=False),
                                  strict=tool.get("strict") is True))
    choice, named, parallel = _choice(body.tool_choice)
    if not functions:
        if named is not None or choice in ("required",):
            raise InvalidRequest("tool_choice: asks for a tool, but no tools are given.",
                                 param="tool_choice")
        return None
    return tools_of(functions, choice, named, parallel, None, "", function_param="tools[{}]")


def _choice(choice: dict[str, Any] | None) -> tuple[str | None, str | None, bool]:
    """``tool_choice`` as the pipeline's choice, the tool it names, and whether
    several calls may be made at once."""
    if choice is None:
        return None, None, True
    kind = choice.get("type")
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    _no_extra(choice, "tool_choice", allowed)
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind == "auto":
        return "auto", None, parallel
    if kind == "any":
        return "required", None, parallel
    if kind == "none":
        return "none", None, parallel
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("tool_choice.name: Field required", param="tool_choice.name")
        return None, name, parallel
    raise InvalidRequest(f"tool_choice.type: {kind!r} is not one of 'auto', 'any', 'tool', "
                         "'none'.", param="tool_choice.type")


_BRACKETS = re.compile(r"\[(\d+)\]")
_PIPELINE_MESSAGE = re.compile(r"^messages\[(\d+)\]")


def anthropic_param(param: str | None, origins: list[str] | None) -> str | None:
    """A ``param`` as Anthropic names fields (``messages.0.content``); a chat
    ``messages[k]`` the pipeline named is the request's field it came from."""
    if not param:
        return param
    if origins is not None:
        match = _PIPELINE_MESSAGE.match(param)
        if match is not None and int(match.group(1)) < len(origins):
            param = origins[int(match.group(1))] + param[match.end():]
    return _BRACKETS.sub(r".\1", param)


def translated(exc: RequestError, origins: list[str]) -> RequestError:
    """``exc`` naming the Messages field its chat ``param`` came from."""
    exc.param = anthropic_param(exc.param, origins)
    return exc
