"""An answer's format, whichever it is: the grammar an engine decodes the answer
in, and the check of the answer once it is made. JSON formats are
schemas/structured.py's, tool calls schemas/tools.py's; the engines and the
generation's final check ask here, so neither of those two needs the other's
dispatch."""

from __future__ import annotations

from schemas.records import ResponseFormat
from schemas.structured import json_grammar, json_violation
from schemas.tools import tools_grammar, tools_violation

__all__ = ["grammar_of", "violation"]


def grammar_of(fmt: ResponseFormat) -> str:
    """The GBNF grammar of a format: text the llama.cpp sampler takes. Raises
    ValueError (saying what it could not compile) for a schema it cannot."""
    if fmt["type"] == "tool_calls":
        return tools_grammar(fmt)
    return json_grammar(fmt)


def violation(fmt: ResponseFormat, text: str) -> str | None:
    """What is wrong with an answer given in ``fmt``, or None when it is right."""
    if fmt["type"] == "tool_calls":
        return tools_violation(fmt, text)
    return json_violation(fmt, text)
