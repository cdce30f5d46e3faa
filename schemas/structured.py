"""Structured outputs: what an answer asked for with ``response_format`` must
be, checked where it is asked and where it is answered.

* **At the API** (:func:`check_format`): a JSON Schema is checked against the
  JSON Schema meta-schema and compiled to the grammar the CPU engines decode
  with; a schema that fails either is a 400 naming the part of it that fails,
  before anything is queued.
* **In the engines** (:func:`grammar_of`): llama.cpp's GBNF grammar of the
  format, compiled once per schema text (``json_object``: any JSON object).
  Decoding is constrained to it, so a finished answer always parses; the
  schema's keywords a grammar cannot express (``minimum``, ``format``, ...)
  are checked after.
* **Once answered** (:func:`violation`): the answer against the schema, with
  ``jsonschema``: what an engine that constrains nothing, or a keyword the
  grammar ignored, let through.

The grammar compiler is llama.cpp's own (``llama_cpp.llama_grammar``): the
GBNF it writes is the one llama.cpp's sampler reads, and it ships with the
CPU engine already; it is imported on the first structured request.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from conveyor.errors import InvalidRequest
from schemas.records import ResponseFormat

__all__ = ["check_format", "format_record", "grammar_of", "violation", "wire_format",
           "SCHEMA_PARAM"]

SCHEMA_PARAM = "response_format.json_schema.schema"
# grammars kept compiled: a schema's text is the key
_GRAMMARS_KEPT = 256


def check_format(fmt: ResponseFormat, param: str = SCHEMA_PARAM) -> None:
    """Raise :class:`InvalidRequest` naming ``param`` and the failing part when
    the format's schema is not a JSON Schema or cannot be compiled (checked
    once per schema text: a client sends the same schema again and again)."""
    if fmt["type"] not in ("json_object", "json_schema"):
        raise InvalidRequest(f"Unknown response_format type {fmt['type']!r}.", param=param)
    if fmt["type"] != "json_schema":
        return
    wrong = _schema_fault(fmt["schema"])
    if wrong is not None:
        raise InvalidRequest(f"Invalid schema for response_format '{fmt['name']}': {wrong}",
                             param=param)


@lru_cache(maxsize=_GRAMMARS_KEPT)
def _schema_fault(schema_text: str) -> str | None:
    """What is wrong with a schema (as JSON text), or None."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        schema = json.loads(schema_text)
    except ValueError as exc:
        return f"it is not JSON: {exc}"
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(the root)"
        return f"at {where}: {exc.message}"
    try:
        _schema_grammar(schema_text)
    except ValueError as exc:
        return str(exc)
    return None


def format_record(kind: str, name: str | None, schema: dict[str, Any] | None,
                  strict: bool | None, param: str = SCHEMA_PARAM) -> ResponseFormat | None:
    """A requested format (chat's ``response_format``, the Responses API's
    ``text.format``) as the pipeline carries it, checked; None for free text.
    A schema left out allows any JSON."""
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(type="json_object", name="", schema="", strict=False)
    fmt = ResponseFormat(type="json_schema", name=name or "", schema=json.dumps(schema or {}),
                         strict=bool(strict))
    check_format(fmt, param=param)
    return fmt


def grammar_of(fmt: ResponseFormat) -> str:
    """The GBNF grammar of a format: text the llama.cpp sampler takes. Raises
    ValueError (saying what it could not compile) for a schema it cannot."""
    if fmt["type"] == "json_object":
        return _json_object_grammar()
    if fmt["type"] == "tool_calls":
        from schemas.tools import tools_grammar

        return tools_grammar(fmt)
    return _schema_grammar(fmt["schema"])


@lru_cache(maxsize=1)
def _json_object_grammar() -> str:
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF  # its root is an object, as OpenAI's json_object asks


@lru_cache(maxsize=_GRAMMARS_KEPT)
def _schema_grammar(schema_text: str) -> str:
    """llama.cpp's compiler closes every object to the properties it names, so
    strict and loose schemas decode alike (a loose schema's answer is the
    narrower one)."""
    from llama_cpp.llama_grammar import SchemaConverter

    schema = json.loads(schema_text)
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                raw_pattern=False)
    try:
        schema = converter.resolve_refs(schema, "schema")
        converter.visit(schema, "")
        return _json_strings(str(converter.format_grammar()))
    except (AssertionError, KeyError, TypeError, ValueError, RecursionError) as exc:
        message = str(exc) or type(exc).__name__
        raise ValueError(message.replace("schema#", "#")) from None


def _json_strings(grammar: str) -> str:
    """The compiler's string characters take raw control characters (a newline
    inside a string), which JSON does not: they may only be escaped."""
    lines = grammar.splitlines()
    for i, rule in enumerate(lines):
        if rule.startswith("char ::= ") and '[^"\\\\]' in rule:
            lines[i] = rule.replace('[^"\\\\]', '[^"\\\\\\x7F\\x00-\\x1F]', 1)
    return "\n".join(lines) + "\n"


def violation(fmt: ResponseFormat, text: str) -> str | None:
    """What is wrong with an answer given in ``fmt``, or None when it is right."""
    if fmt["type"] == "tool_calls":
        from schemas.tools import tools_violation

        return tools_violation(fmt, text)
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"the answer is not JSON: {exc}"
    if fmt["type"] == "json_object":
        return None if isinstance(value, dict) else "the answer is not a JSON object"
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(json.loads(fmt["schema"]))
    error = next(iter(validator.iter_errors(value)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(the root)"
    return f"the answer does not match the schema at {where}: {error.message}"


def wire_format(fmt: ResponseFormat) -> dict[str, Any]:
    """The format in OpenAI's ``response_format`` shape (for an upstream engine)."""
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {
        "name": fmt["name"], "schema": json.loads(fmt["schema"]), "strict": fmt["strict"]}}
