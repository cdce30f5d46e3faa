"""A request's response_format as vLLM's structured outputs (its own guided
decoding: xgrammar, llguidance or outlines, whichever vLLM picks for the
schema), for the in-process vLLM engine. A request's tools (a ``tool_calls``
format, schemas/tools.py) go as their grammar, the GBNF the llama.cpp engines
decode with, which xgrammar parses too.

vLLM compiles the schema and holds every draw to it, so a finished answer
parses. What it cannot do is begin inside a schema: a request carries no
answer so far for its grammar to stand after. A structured answer that
another run began (the worker's death) therefore cannot be continued on vLLM
and ends with an EngineError saying so; the llama.cpp engines walk the answer
so far through their grammar and continue it (llamacpp_grammar).
"""

from __future__ import annotations

import json
from typing import Any

from conveyor.errors import EngineError
from schemas.answer_format import grammar_of
from workers.infer.engines.base import GenerationRequest

__all__ = ["structured_outputs"]


def structured_outputs(request: GenerationRequest) -> Any:
    """vLLM's ``StructuredOutputsParams`` of the request, or None for free text."""
    fmt = request.response_format
    if fmt is None:
        return None
    if request.continuation:
        raise EngineError("vLLM cannot continue a structured answer another run began: "
                          "its structured outputs start at the schema's beginning")
    from vllm.sampling_params import StructuredOutputsParams

    if fmt["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt["type"] == "tool_calls":  # the tools' GBNF, which xgrammar reads as well
        return StructuredOutputsParams(grammar=grammar_of(fmt))
    return StructuredOutputsParams(json=json.loads(fmt["schema"]))
