"""Chat's ``response_format``: free text, any JSON object, or JSON matching a
schema, as pydantic models (schemas/structured.py checks the schema)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.openai.fields import STRICT, Text
from schemas.records import ResponseFormat as ResponseFormatRecord
from schemas.structured import format_record

__all__ = ["JsonSchemaSpec", "ResponseFormat"]


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
