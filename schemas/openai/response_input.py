"""The input of a Responses API request (``POST /v1/responses``): message
items, function calls a previous response made and their outputs, and the
function tools offered, as pydantic models; and the conversation they make as
chat turns (:func:`conversation`). The request itself is
:mod:`schemas.openai.responses`."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from schemas.openai.fields import FUNCTION_NAME, STRICT, Text
from schemas.openai.tool_params import parameters_within_bounds
from schemas.records import Function, Message, ToolCall

__all__ = ["InputText", "InputMessage", "FunctionCallItem", "FunctionCallOutputItem",
           "InputItem", "FunctionTool", "FunctionChoice", "conversation"]

Role = Literal["user", "assistant", "system", "developer"]


class InputText(BaseModel):
    model_config = STRICT

    type: Literal["input_text", "output_text"]
    text: Text


class InputMessage(BaseModel):
    model_config = STRICT

    type: Literal["message"] = "message"
    role: Role
    content: Text | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


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
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


def _item_kind(item: Any) -> str:
    """Which model reads an input item: a call, a call's output, or (any other
    type, which it then refuses naming the type) a message."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")
    return kind if kind in ("function_call", "function_call_output") else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind)]


class FunctionTool(BaseModel):
    """A function the model may call (the Responses API's flat shape)."""

    model_config = STRICT

    type: Literal["function"]
    name: Text = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None

    _within_bounds = field_validator("parameters")(parameters_within_bounds)

    def record(self) -> Function:
        return Function(name=self.name, description=self.description or "",
                        parameters=json.dumps(self.parameters) if self.parameters is not None
                        else "", strict=bool(self.strict))


class FunctionChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    name: Text


def conversation(instructions: str | None, items: str | list[InputItem]) -> list[Message]:
    """The conversation as chat turns: ``instructions`` first as a system
    message (as OpenAI puts them before the input), each message item a turn,
    function calls joined to the assistant turn they follow (or one of their
    own), and each call's output a tool turn."""
    turns = [_turn("system", instructions)] if instructions is not None else []
    if isinstance(items, str):
        return [*turns, _turn("user", items)]
    for item in items:
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
    return turns


def _turn(role: str, content: str, tool_call_id: str | None = None) -> Message:
    return Message(role=role, content=content, name=None, tool_calls=None,
                   tool_call_id=tool_call_id)
