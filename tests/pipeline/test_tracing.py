"""One trace per request across the processes, continued from the client's header."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx

from tests.support.pipeline import Pipeline

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_every_layer_adds_a_span_to_the_clients_trace(
        pipeline_factory: Callable[..., Pipeline]) -> None:
    traced = pipeline_factory(CONVEYOR_TRACE_EXPORTER="console")
    r = httpx.post(f"{traced.base_url}/v1/completions", timeout=60,
                   headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
                   json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200
    traced.close(grace_s=10.0)  # the processes flush their spans as they exit
    text = "\n".join((traced.logs / f"{traced.prefix}-{name}.log").read_text(errors="replace")
                     for name in traced.procs)
    # ConsoleSpanExporter writes each span as an indented JSON object
    spans = re.findall(r'"name": "(\w+)",\s*"context": \{\s*"trace_id": "0x(\w+)"', text)
    layers = {name for name, trace_id in spans if trace_id == TRACE_ID}
    assert layers >= {"gateway", "preprocess", "route", "schedule", "infer", "postprocess"}
    # the GenAI conventions' attributes: the request's on the gateway span, and its
    # usage and finish on the infer span
    by_name = {span["name"]: span["attributes"] for span in _spans(text)
               if span["context"]["trace_id"] == f"0x{TRACE_ID}"}
    assert by_name["gateway"]["gen_ai.request.model"] == "smollm2"
    assert by_name["gateway"]["gen_ai.operation.name"] == "text_completion"
    infer = by_name["infer"]
    assert infer["gen_ai.request.max_tokens"] == 4 and infer["gen_ai.request.temperature"] == 1.0
    assert infer["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert infer["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert infer["gen_ai.response.finish_reasons"] == [r.json()["choices"][0]["finish_reason"]]


def _spans(text: str) -> list[dict[str, Any]]:
    """The spans ConsoleSpanExporter wrote: JSON objects from a line "{" to a line "}"."""
    spans: list[dict[str, Any]] = []
    lines: list[str] | None = None
    for line in text.splitlines():
        if line == "{":
            lines = [line]
        elif lines is not None:
            lines.append(line)
            if line == "}":
                spans.append(json.loads("\n".join(lines)))
                lines = None
    return spans
