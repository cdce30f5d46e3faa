"""One trace per request across the processes, continued from the client's header."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Pipeline

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def traced(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("trace-logs"), CONVEYOR_TRACE_EXPORTER="console")
    try:
        p.start(workers=1, contexts=1)
        yield p
    finally:
        p.close()


def test_every_layer_adds_a_span_to_the_clients_trace(traced: Pipeline) -> None:
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
