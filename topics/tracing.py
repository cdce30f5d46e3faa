"""One trace per request across every layer (OpenTelemetry, W3C trace
context): each layer's span is the child of the ``traceparent`` in the
envelope and writes its own back; produced events carry it as a Kafka header
too. Exporters (``CONVEYOR_TRACE_EXPORTER``): docs/operating/observability.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from conveyor.errors import ConveyorError
from schemas.records import Envelope, Generation

__all__ = ["GENAI_OPERATIONS", "Tracing", "genai_request_attributes", "make_tracer",
           "layer_span", "trace_id_of"]

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class Tracing:
    """A process's tracer, and how to flush what it recorded before exiting."""

    tracer: trace.Tracer
    provider: TracerProvider | None = None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def make_tracer(exporter: str, service: str,
                span_exporter: SpanExporter | None = None) -> Tracing:
    """The tracer of one process. A ``span_exporter`` given here overrides the
    setting and receives each span as it ends (tests); the others batch."""
    processor: SpanProcessor
    if span_exporter is not None:
        processor = SimpleSpanProcessor(span_exporter)
    else:
        if exporter == "none":
            return Tracing(trace.NoOpTracer())
        if exporter == "console":
            span_exporter = ConsoleSpanExporter()
        elif exporter == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found]
                    OTLPSpanExporter,
                )
            except ImportError as exc:
                raise ConveyorError(
                    "CONVEYOR_TRACE_EXPORTER=otlp needs opentelemetry-exporter-otlp") from exc
            span_exporter = OTLPSpanExporter()
        else:
            raise ConveyorError(f"unknown trace exporter {exporter!r}")
        processor = BatchSpanProcessor(span_exporter)
    provider = TracerProvider(resource=Resource.create({"service.name": f"conveyor-{service}"}))
    provider.add_span_processor(processor)
    return Tracing(provider.get_tracer("conveyor"), provider)


# gen_ai.operation.name of each generation kind (OpenTelemetry GenAI conventions)
GENAI_OPERATIONS = {"chat": "chat", "completion": "text_completion", "embedding": "embeddings"}


def genai_request_attributes(generation: Generation) -> dict[str, AttributeValue]:
    """The GenAI conventions' request attributes of a generation."""
    sampling = generation["sampling"]
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": GENAI_OPERATIONS[generation["kind"]],
        "gen_ai.request.model": generation["model"],
        "gen_ai.request.temperature": sampling["temperature"],
        "gen_ai.request.top_p": sampling["top_p"],
    }
    if sampling["max_tokens"] is not None:
        attributes["gen_ai.request.max_tokens"] = sampling["max_tokens"]
    if sampling["seed"] is not None:
        attributes["gen_ai.request.seed"] = sampling["seed"]
    return attributes


@contextmanager
def layer_span(tracer: trace.Tracer, name: str, envelope: Envelope) -> Iterator[trace.Span]:
    """A span for ``name`` under the envelope's trace; the envelope then points at it."""
    if isinstance(tracer, trace.NoOpTracer):  # tracing off: nothing to parse on the hot path
        yield trace.INVALID_SPAN
        return
    parent = _PROPAGATOR.extract({"traceparent": envelope["traceparent"]})
    with tracer.start_as_current_span(name, context=parent, attributes={
        "conveyor.request_id": envelope["request_id"],
        "conveyor.tenant": envelope["tenant"],
        "conveyor.attempt": envelope["attempt"],
    }) as span:
        if span.get_span_context().is_valid:
            carrier: dict[str, str] = {}
            _PROPAGATOR.inject(carrier)
            envelope["traceparent"] = carrier.get("traceparent", envelope["traceparent"])
        yield span


def trace_id_of(envelope: Envelope) -> str:
    """The trace id in the envelope (for log lines)."""
    parts = envelope["traceparent"].split("-")
    return parts[1] if len(parts) == 4 else ""
