"""The function tools of a chat request, and the calls an assistant turn of
its history made, as pydantic models (OpenAI's nested shape: ``{"type":
"function", "function": {...}}``). schemas/tools.py checks what they ask."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from schemas.openai.fields import FUNCTION_NAME, STRICT, Text
from schemas.records import Function as FunctionRecord
from schemas.records import ToolCall as ToolCallRecord
from schemas.structured import schema_bounds_fault

__all__ = ["CalledFunction", "MessageToolCall", "FunctionSpec", "Tool", "NamedFunction",
           "NamedToolChoice", "parameters_within_bounds"]



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
