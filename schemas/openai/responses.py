"""OpenAI's Responses API request (``POST /v1/responses``), text only, as
strict pydantic models: the rules of chat's (:mod:`schemas.openai.requests`),
the input items (messages, function calls and their outputs) and the
conversation they make as chat turns (:func:`conversation`). What is served
and refused: docs/api/responses.md#how-a-request-is-checked. Validation runs
here, not in FastAPI's body parsing, so a 400 names the Responses API's own
parameter (``input[1].content``, ``max_output_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from conveyor.errors import InvalidRequest
from schemas.openai.fields import (
    FUNCTION_NAME,
    STRICT,
    Text,
    image_parts,
    joined,
    json_object,
)
from schemas.openai.requests import (
    MAX_INT32,
    FunctionSpec,
    Metadata,
    NamedFunction,
    invalid_request,
    model_field_names,
    needs_tools,
    refused,
    unsupported,
)
from schemas.records import ImageRef, Message, ToolCall, Tools, Usage
from schemas.records import ResponseFormat as ResponseFormatRecord
from schemas.structured import format_record
from schemas.tools import tools_of

__all__ = ["response_usage", "answer_items", "InputText", "InputImage", "InputMessage",
           "FunctionCallItem",
           "FunctionCallOutputItem", "InputItem", "FunctionTool", "FunctionChoice",
           "conversation", "TextFormat", "TextConfig", "ResponsesRequest", "parse_request",
           "field_names"]

Role = Literal["user", "assistant", "system", "developer"]

# what ``include`` may name: the output text's log probabilities
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(BaseModel):
    model_config = STRICT

    type: Literal["input_text", "output_text"]
    text: Text


class InputImage(BaseModel):
    """An image in a message (docs/api/responses.md): a data URL, or an http(s)
    URL of a host the operator allows; ``file_id`` is refused by the gateway."""

    model_config = STRICT

    type: Literal["input_image"]
    image_url: Text | None = None
    file_id: Text | None = None
    detail: Literal["auto", "low", "high"] = "auto"


def _part_kind(part: Any) -> str:
    """An image part, else a text part (which refuses any other type, naming it)."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "InputImage" if kind == "input_image" else "InputText"


InputPart = Annotated[Annotated[InputText, Tag("InputText")]
                      | Annotated[InputImage, Tag("InputImage")], Discriminator(_part_kind)]


class InputMessage(BaseModel):
    model_config = STRICT

    type: Literal["message"] = "message"
    role: Role
    content: Text | list[InputPart]

    def text(self) -> str:
        return joined(self.content)

    @model_validator(mode="after")
    def _images_from_users(self) -> InputMessage:
        if self.role != "user" and self.image_parts():
            raise ValueError("input_image parts are only allowed in messages with role 'user'")
        return self

    def image_parts(self) -> list[tuple[int, int, InputImage]]:
        """Each image part: its index in the content, the characters of text
        before it, the part."""
        return image_parts(self.content, InputImage)


class FunctionCallItem(BaseModel):
    """A call a previous response made, sent back as part of the conversation."""

    model_config = STRICT

    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: Text = Field(pattern=FUNCTION_NAME)
    arguments: Text
    id: Text | None = None
    status: Text | None = None

    def record(self) -> ToolCall:
        return ToolCall(id=self.call_id, name=self.name, arguments=self.arguments)


class FunctionCallOutputItem(BaseModel):
    """A call's result."""

    model_config = STRICT

    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: Text | list[InputText]
    id: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        return joined(self.output)


def _item_kind(item: Any) -> str:
    """Which model reads an input item: a call, a call's output, or (any other
    type, which it then refuses naming the type) a message."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")
    return kind if kind in ("function_call", "function_call_output") else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind)]


class _FunctionType(BaseModel):
    model_config = STRICT

    type: Literal["function"]


class FunctionTool(FunctionSpec, _FunctionType):
    """A function the model may call: the Responses API's flat shape, chat's
    function with its ``type`` beside it (a base listed last gives the first
    fields: the type is checked first, so a tool of another type is refused
    by its type)."""


class FunctionChoice(NamedFunction, _FunctionType):
    """A named ``tool_choice``: its ``type``, then the function's ``name``."""


def conversation(instructions: str | None, items: str | list[InputItem],
                 images: Mapping[tuple[int, int], ImageRef] | None = None) -> list[Message]:
    """The conversation as chat turns: ``instructions`` first as a system
    message (as OpenAI puts them before the input), each message item a turn
    (with its stored images, ``images`` by (item index, content index):
    gateway/images.py; an image part without one is refused, naming it: none
    is the WebSocket's mode, which takes no images),
    function calls joined to the assistant turn they follow (or one of their
    own), and each call's output a tool turn."""
    turns = [_turn("system", instructions)] if instructions is not None else []
    if isinstance(items, str):
        return [*turns, _turn("user", items)]
    for index, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            last = turns[-1] if turns else None
            if last is None or last["role"] != "assistant":
                last = _turn("assistant", "")
                turns.append(last)
            last["tool_calls"] = [*(last.get("tool_calls") or []), item.record()]
        elif isinstance(item, FunctionCallOutputItem):
            turns.append(_turn("tool", item.text(), tool_call_id=item.call_id))
        else:
            turns.append(_turn(item.role, item.text()))
            refs = []
            for j, _, _ in item.image_parts():
                ref = (images or {}).get((index, j))
                if ref is None:
                    where = f"input[{index}].content[{j}]"
                    raise InvalidRequest(f"Invalid '{where}': " + (
                        "image parts are taken by POST /v1/responses only." if images is None
                        else "this gateway takes no image parts."), param=where)
                refs.append(ref)
            turns[-1]["images"] = refs or None
    return turns


def answer_items(output: list[dict[str, Any]]) -> list[InputItem]:
    """A response's output items (its message's text, its function calls) as
    the input items a next turn sends back, for :func:`conversation`."""
    items: list[InputItem] = []
    for item in output:
        if item["type"] == "function_call":
            items.append(FunctionCallItem.model_construct(
                type="function_call", call_id=item["call_id"], name=item["name"],
                arguments=item["arguments"]))
        elif item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            items.append(InputMessage.model_construct(type="message", role="assistant",
                                                      content=text))
    return items


def _turn(role: str, content: str, tool_call_id: str | None = None) -> Message:
    return Message(role=role, content=content, name=None, tool_calls=None,
                   tool_call_id=tool_call_id, images=None)


class TextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or JSON matching a schema,
    OpenAI's flat shape (``name``, ``schema``, ``strict``, ``description``)
    beside ``type``; checked as chat's ``response_format`` is."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False,
                              populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = Field(default=None, min_length=1, max_length=64,
                              pattern=r"^[a-zA-Z0-9_-]+$")
    description: Text | None = None
    # OpenAI's field is ``schema``, a name pydantic's models keep for themselves
    schema_: dict[Text, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> TextFormat:
        if self.type == "json_schema" and self.name is None:
            raise ValueError("text.format of type 'json_schema' needs a 'name'")
        return self

    def record(self) -> ResponseFormatRecord | None:
        """The format as the pipeline carries it, checked; None for free text."""
        return format_record(self.type, self.name, self.schema_, self.strict,
                             param="text.format.schema")

    def echo(self) -> dict[str, Any]:
        """The format as a response object shows it."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "schema": self.schema_ or {},
                "strict": bool(self.strict), "description": self.description}


class TextConfig(BaseModel):
    model_config = STRICT

    format: TextFormat | None = None
    verbosity: Any = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, v: Any) -> None:
        if v is not None:
            raise unsupported("text.verbosity")
        return None


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``: what Conveyor serves of it."""

    model_config = STRICT

    model: Text = Field(min_length=1)
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = False
    background: bool | None = False
    store: bool | None = None
    metadata: Metadata = None
    text: TextConfig | None = None
    # accepted and without effect here
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    service_tier: Text | None = None
    stream_options: dict[str, Any] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[Text] | None = None
    # the stored response this one continues (its conversation goes first)
    previous_response_id: Text | None = Field(default=None, min_length=1, max_length=128)
    # refused unless they ask for nothing
    truncation: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    background_options: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_options: Any = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, v: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(v, list) and not v:
            raise ValueError("input must hold at least one message")
        return v

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, v: Any) -> None:
        if v not in (None, "disabled"):
            raise ValueError("only truncation 'disabled' is supported")
        return None

    _choice_of_tools = needs_tools(None, "none", "auto")

    @field_validator("include")
    @classmethod
    def _includes(cls, v: list[str] | None) -> list[str] | None:
        for item in v or ():
            if item != LOGPROBS_INCLUDE:
                raise ValueError(f"include {item!r} is not supported by this server (only "
                                 f"{LOGPROBS_INCLUDE!r})")
        return v

    def logprobs_asked(self) -> tuple[bool, int]:
        """Whether the output text's tokens' log probabilities are asked for
        (``include`` names them), and how many likeliest at each place."""
        return LOGPROBS_INCLUDE in (self.include or ()), self.top_logprobs or 0

    _nothing = refused("conversation", "prompt", "reasoning",
                       "max_tool_calls", "context_management", "background_options",
                       "moderation", "image", "access_programs", "prompt_cache_options",
                       allowed=(None, [], {}))

    def messages(self, images: Mapping[tuple[int, int], ImageRef] | None = None
                 ) -> list[Message]:
        """The conversation as chat turns (:func:`conversation`)."""
        return conversation(self.instructions, self.input, images)

    def reads_calls(self) -> bool:
        """Whether the answer is read for function calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def tools_record(self) -> Tools | None:
        """The tools as the pipeline carries them, checked (each fault an
        :class:`InvalidRequest` naming its parameter); None without tools."""
        choice = self.tool_choice
        named = choice.name if isinstance(choice, FunctionChoice) else None
        fmt = self.text.format if self.text else None
        return tools_of([t.record() for t in self.tools or ()],
                        None if isinstance(choice, FunctionChoice) else choice, named,
                        self.parallel_tool_calls, fmt.type if fmt else None, "text.format",
                        function_param="tools[{}]")

    def tools_echo(self) -> tuple[list[dict[str, Any]], Any, bool]:
        """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a response
        object shows them."""
        tools = [{"type": "function", "name": t.name, "description": t.description,
                  "parameters": t.parameters, "strict": bool(t.strict)}
                 for t in self.tools or []]
        choice: Any = self.tool_choice.model_dump() if isinstance(
            self.tool_choice, FunctionChoice) else self.tool_choice or "auto"
        return tools, choice, self.parallel_tool_calls is not False


def field_names() -> frozenset[str]:
    """Every field name of the Responses request's models: what a ``param`` may hold."""
    return model_field_names(
        ResponsesRequest, InputMessage, InputText, InputImage, TextConfig, TextFormat,
        FunctionTool,
        FunctionChoice, FunctionCallItem, FunctionCallOutputItem)


def parse_request(raw: bytes) -> ResponsesRequest:
    """Validate a request body; every refusal is an :class:`InvalidRequest` (400)
    naming its ``param``."""
    data = json_object(raw)
    try:
        body = ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(exc.errors(), field_names()) from None
    if body.background and body.store is False:
        raise InvalidRequest("background responses must be stored: store cannot be false "
                             "with background true (store)", param="store")
    return body


def response_usage(usage: Usage) -> dict[str, Any]:
    """A Response object's ``usage``: input (of it, what the engine's prefix cache
    held) and output tokens, and their total."""
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}
