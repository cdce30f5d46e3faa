"""One trace per request: each layer's span is the child of the one before."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from topics.envelope import new_envelope
from topics.tracing import layer_span, make_tracer, trace_id_of


def test_spans_chain_through_the_envelope() -> None:
    exporter = InMemorySpanExporter()
    tracer = make_tracer("none", "test", span_exporter=exporter).tracer
    envelope = new_envelope("r1", reply_gateway="g", reply_partition=0)
    client_trace = trace_id_of(envelope)
    for layer in ("gateway", "preprocess", "route", "schedule", "infer", "postprocess"):
        with layer_span(tracer, layer, envelope):
            pass
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["gateway", "preprocess", "route", "schedule", "infer",
                                       "postprocess"]
    assert {format(s.context.trace_id, "032x") for s in spans} == {client_trace}
    for parent, child in zip(spans, spans[1:], strict=False):
        assert child.parent is not None and child.parent.span_id == parent.context.span_id
    assert spans[0].attributes is not None
    assert spans[0].attributes["conveyor.request_id"] == "r1"
    # the envelope now points at the last span: the next hop would be its child
    assert envelope["traceparent"].split("-")[2] == format(spans[-1].context.span_id, "016x")


def test_without_an_exporter_nothing_is_recorded_and_the_envelope_is_kept() -> None:
    tracer = make_tracer("none", "test").tracer
    envelope = new_envelope("r1", reply_gateway="g", reply_partition=0)
    before = envelope["traceparent"]
    with layer_span(tracer, "route", envelope):
        pass
    assert envelope["traceparent"] == before
