"""OpenAI's chat and completion request bodies, as strict pydantic models.

Only values the pipeline can carry are accepted (strict types, numbers that fit
their Avro field, text UTF-8 can hold); a parameter Conveyor cannot honour is a
400 naming it, never silently ignored. The rules: docs/api/chat.md#how-a-request-is-checked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from conveyor.errors import InvalidRequest
from schemas.openai.embeddings import EmbeddingBody
from schemas.openai.feedback import FeedbackBody
from schemas.openai.fields import FUNCTION_NAME, STRICT, Text, image_parts, joined
from schemas.openai.moderations import ModerationBody, ModerationText
from schemas.records import Function as FunctionRecord
from schemas.records import ResponseFormat as ResponseFormatRecord
from schemas.records import ToolCall as ToolCallRecord
from schemas.records import Tools as ToolsRecord
from schemas.structured import format_record, schema_bounds_fault
from schemas.tools import MAX_TOOLS, tools_of

__all__ = ["ChatMessage", "ChatCompletionRequest", "CompletionRequest", "StreamOptions",
           "TextPart", "ImagePart", "ImageUrl", "ContentPart", "Text", "field_names",
           "model_list", "MAX_INT32", "MIN_INT64", "MAX_INT64",
           "FUNCTION_NAME", "checked_metadata", "Metadata", "model_field_names", "unsupported",
           "JsonSchemaSpec", "ResponseFormat", "CalledFunction", "MessageToolCall",
           "FunctionSpec", "Tool", "NamedFunction", "NamedToolChoice", "parameters_within_bounds",
           "param_of", "invalid_request", "refused", "needs_tools"]

MAX_INT32 = 2**31 - 1
# OpenAI's bound on the tokens one logit_bias may bias
MAX_LOGIT_BIAS = 300
# OpenAI's bound on top_logprobs
MAX_TOP_LOGPROBS = 20
# the most choices one request may ask for (n), each a request of its own
MAX_CHOICES = 8
MIN_INT64, MAX_INT64 = -(2**63), 2**63 - 1


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``: a named JSON Schema the answer must match."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False,
                              populate_by_name=True)

    name: Text = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Text | None = None
    # OpenAI's field is ``schema``, a name pydantic's models keep for themselves
    schema_: dict[Text, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON matching a schema.
    A schema that is not a JSON Schema, or that Conveyor cannot compile, is
    refused (schemas/structured.py)."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs its "
                             "'json_schema' object (name, schema, strict)")
        return self

    def record(self) -> ResponseFormatRecord | None:
        """The format as the pipeline carries it, checked; None for free text."""
        spec = self.json_schema
        return format_record(self.type, spec.name if spec else None,
                             spec.schema_ if spec else None, spec.strict if spec else None)


def parameters_within_bounds(cls: type, v: dict[str, Any] | None,
                             info: ValidationInfo) -> dict[str, Any] | None:
    """A function's ``parameters`` within Conveyor's bounds on a schema, checked
    before anything recurses into it (chat's tools and the Responses API's)."""
    wrong = schema_bounds_fault(v) if v is not None else None
    if wrong is not None:
        raise ValueError(f"Invalid parameters schema for function "
                         f"{info.data.get('name')!r}: {wrong}")
    return v


class CalledFunction(BaseModel):
    model_config = STRICT

    name: Text = Field(pattern=FUNCTION_NAME)
    arguments: Text


class MessageToolCall(BaseModel):
    """A call an assistant turn of the history made."""

    model_config = STRICT

    id: Text = Field(min_length=1)
    type: Literal["function"] = "function"
    function: CalledFunction

    def record(self) -> ToolCallRecord:
        return ToolCallRecord(id=self.id, name=self.function.name,
                              arguments=self.function.arguments)


class FunctionSpec(BaseModel):
    model_config = STRICT

    name: Text = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None

    _within_bounds = field_validator("parameters")(parameters_within_bounds)

    def record(self) -> FunctionRecord:
        return FunctionRecord(name=self.name, description=self.description or "",
                              parameters=json.dumps(self.parameters) if self.parameters
                              is not None else "", strict=bool(self.strict))


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = STRICT

    name: Text


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: Text


class ImageUrl(BaseModel):
    model_config = STRICT

    # a data URL (data:image/png;base64,...), or an http(s) URL of a host the
    # operator allows (gateway/images.py checks and stores it)
    url: Text = Field(min_length=1)
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(BaseModel):
    """An image in a message (docs/api/chat.md#images)."""

    model_config = STRICT

    type: Literal["image_url"]
    image_url: ImageUrl


def _part_kind(part: Any) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return {"text": "TextPart", "image_url": "ImagePart"}.get(kind) if isinstance(
        kind, str) else None


# the part its type names (tagged by the models' names, which are no field of a
# param: an error in a part names it as messages[0].content[1].text)
ContentPart = Annotated[Annotated[TextPart, Tag("TextPart")]
                        | Annotated[ImagePart, Tag("ImagePart")],
                        Discriminator(_part_kind, custom_error_type="invalid_part",
                                      custom_error_message="Invalid content part: expected "
                                      "a 'type' of 'text' or 'image_url'")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _tool_turns(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may hold tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role != "user" and self.image_parts():
            raise ValueError("image parts are only allowed in messages with role 'user'")
        return self

    def text(self) -> str:
        return joined(self.content)

    def image_parts(self) -> list[tuple[int, int, ImagePart]]:
        """Each image part: its index in the content, the characters of text
        before it, the part."""
        return image_parts(self.content, ImagePart)


METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512


def checked_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 pairs, keys of 64 characters, values of 512."""
    if v is None:
        return None
    if len(v) > METADATA_PAIRS:
        raise ValueError(f"metadata holds at most {METADATA_PAIRS} pairs")
    for key, value in v.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise ValueError(f"metadata keys hold at most {METADATA_KEY_CHARS} "
                             f"characters and values {METADATA_VALUE_CHARS}")
    return v


Metadata = Annotated[dict[Text, Text] | None, AfterValidator(checked_metadata)]


def unsupported(name: str) -> ValueError:
    return ValueError(f"{name} is not supported by this server")


def refused(*fields: str, allowed: tuple[Any, ...] = (None, [])) -> Any:
    """The validator of parameters Conveyor does not support: refused (naming
    the field) unless they hold one of ``allowed``, which asks for nothing."""
    def check(cls: type, v: Any, info: ValidationInfo) -> None:
        if v not in allowed:
            raise unsupported(str(info.field_name))
        return None
    return field_validator(*fields)(check)


def needs_tools(*allowed: Any) -> Any:
    """The validator of ``tool_choice``: only ``allowed`` without tools."""
    def check(cls: type, v: Any, info: ValidationInfo) -> Any:
        if not info.data.get("tools") and v not in allowed:
            raise ValueError("tool_choice is only allowed when tools are given")
        return v
    return field_validator("tool_choice")(check)


class _Sampling(BaseModel):
    model_config = STRICT

    model: Text = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, ge=MIN_INT64, le=MAX_INT64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    user: Text | None = None
    # kept with a stored chat completion (store: true); refused on completions
    metadata: Metadata = None
    store: bool | None = None
    # accepted and without effect here
    service_tier: Text | None = None
    logit_bias: dict[Text, float | int] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return [s for s in stops if s]

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int | None) -> int:
        if v is not None and not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be between 1 and {MAX_CHOICES}")
        return v or 1

    def choices(self) -> int:
        """How many choices are asked for (gateway/chat/serving.py serves more than one)."""
        return self.n or 1

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float | int] | None) -> dict[str, float] | None:
        if not v:
            return None
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens")
        out: dict[str, float] = {}
        for token, bias in v.items():
            if not token.isascii() or not token.isdigit() or int(token) > MAX_INT32:
                raise ValueError(f"logit_bias keys are token ids (integers >= 0); "
                                 f"{token!r} is not one")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {token} must be between -100 and 100, "
                                 f"not {bias}")
            out[str(int(token))] = float(bias)
        return out

    def bias(self) -> dict[str, float]:
        return dict(self.logit_bias or {})

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def penalties(self) -> tuple[float, float]:
        return self.presence_penalty or 0.0, self.frequency_penalty or 0.0


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # refused unless they ask for nothing
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    def logprobs_asked(self) -> tuple[bool, int]:
        return bool(self.logprobs), self.top_logprobs or 0

    _nothing = refused("functions", "audio", "prediction", "web_search_options",
                       "reasoning_effort")
    _no_call = refused("function_call", allowed=(None, "none"))
    _choice_of_tools = needs_tools(None, "none")

    def tools_record(self) -> ToolsRecord | None:
        """The tools as the pipeline carries them, checked (each fault an
        :class:`InvalidRequest` naming its parameter); None without tools."""
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return tools_of([t.function.record() for t in self.tools or ()],
                        None if isinstance(choice, NamedToolChoice) else choice, named,
                        self.parallel_tool_calls,
                        self.response_format.type if self.response_format else None,
                        "response_format")

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, v: Any) -> None:
        if v not in (None, ["text"]):
            raise ValueError("only the 'text' modality is supported")
        return None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Text | list[Text]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_INT32)
    echo: bool | None = False
    # the sampled token's log probability and this many alternatives (OpenAI's
    # legacy completions allow 5)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    # refused unless they ask for nothing
    suffix: Text | None = None
    best_of: int | None = None

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("store=true is supported for chat completions only: "
                             "completions are not stored")
        return v

    def logprobs_asked(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    _no_suffix = refused("suffix", allowed=(None, ""))

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v: int | None) -> None:
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return None

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise InvalidRequest("Only a single prompt per request is supported.",
                                 param="prompt")
        return self.prompt[0]

    def token_budget(self) -> int | None:
        if self.echo:
            raise InvalidRequest("echo is not supported.", param="echo")
        return 16 if self.max_tokens is None else self.max_tokens


_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest,
                                        ChatMessage, TextPart, ImagePart, ImageUrl,
                                        StreamOptions, ResponseFormat,
                                        JsonSchemaSpec, Tool, FunctionSpec, NamedToolChoice,
                                        NamedFunction, MessageToolCall, CalledFunction,
                                        FeedbackBody, ModerationBody, ModerationText,
                                        EmbeddingBody)


@cache
def model_field_names(*models: type[BaseModel]) -> frozenset[str]:
    """Every field name of ``models``: what may appear in a ``param``."""
    return frozenset(field.alias or name for model in models
                     for name, field in model.model_fields.items())


def field_names() -> frozenset[str]:
    """Every field name of the chat and completion request models."""
    return model_field_names(*_MODELS)


def param_of(loc: Sequence[int | str], names: frozenset[str] | None = None) -> str | None:
    """The OpenAI ``param`` of a pydantic error location (``messages[0].content``,
    ``input[0].content[1].text``): list indexes in brackets, and the type tags
    pydantic adds inside unions (``str``, ``list[str]``) left out. ``names`` are
    the field names a param may hold (default: the chat and completion models')."""
    names = field_names() if names is None else names
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names:
            out += f".{part}" if out else part
    return out or None


def invalid_request(errors: Sequence[Any], names: frozenset[str] | None = None) -> InvalidRequest:
    """The 400 of a body's validation errors: the most telling one's message, naming
    its ``param`` (of ``names``, as :func:`param_of`). The most telling is, of the
    first field's errors, the one that got furthest: a wrong value before a wrong
    type, then the deepest location (the branch of a union that applied). FastAPI's
    ``body`` ahead of a location is no part of it."""
    located = [{**e, "loc": [p for p in e["loc"] if p != "body"]} for e in errors]
    field = located[0]["loc"][:1] if located else []
    first: dict[str, Any] = max(
        (e for e in located if e["loc"][:1] == field), default={},
        key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e["loc"])))
    if first.get("type") == "json_invalid":
        return InvalidRequest("The request body is not valid JSON.")
    param = param_of(first.get("loc", ()), names)
    msg = str(first.get("msg", "Invalid request")).removeprefix("Value error, ")
    if first.get("type") == "string_unicode":  # pydantic's own check of constrained strings
        msg = "must be valid Unicode text; it holds a lone surrogate (such as \\ud800)"
    return InvalidRequest(msg + (f" ({param})" if param else ""), param=param)


def model_list(names: list[tuple[str, int]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "conveyor"}
            for name, created in names
        ],
    }
