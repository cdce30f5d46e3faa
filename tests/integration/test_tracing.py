"""One trace per request across the processes, continued from the client's header."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import pytest

from tests.conftest import Pipeline

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_every_layer_adds_a_span_to_the_clients_trace(
        pipeline_factory: Callable[..., Pipeline]) -> None:
    traced = pipeline_factory(CONVEYOR_TRACE_EXPORTER="console")
    r = httpx.post(f"{traced.base_url}/v1/completions", timeout=60,
                   headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
                   json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200
    traced.close()  # the processes flush their spans as they exit
    text = "\n".join((traced.logs / f"{traced.prefix}-{name}.log").read_text(errors="replace")
                     for name in traced.procs)
    # ConsoleSpanExporter writes each span as an indented JSON object
    spans = re.findall(r'"name": "(\w+)",\s*"context": \{\s*"trace_id": "0x(\w+)"', text)
    layers = {name for name, trace_id in spans if trace_id == TRACE_ID}
    assert layers >= {"gateway", "preprocess", "route", "schedule", "infer", "postprocess"}
