"""Prometheus metrics of every Conveyor process, through OpenTelemetry: one
``MeterProvider`` a process, turned into the Prometheus text format at each
scrape (so dots become underscores, seconds add ``_seconds``, counters end in
``_total``). The gateway serves ``GET /metrics`` on its own port, other
processes on ``metrics_port`` (0: a no-op meter). The list:
docs/operating/observability.md; the cost:
docs/decisions/0025-resumable-streams-and-metrics.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Counter, Meter, NoOpMeterProvider, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from conveyor.settings import TelemetrySettings

__all__ = ["CONTENT_TYPE", "DURATION_BUCKETS", "TOKEN_BUCKETS", "TPOT_BUCKETS", "TTFT_BUCKETS",
           "GatewayMetrics", "LayerMetrics", "LayerProbe", "Metrics", "WorkerMetrics",
           "partition_lag", "process_metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# the GenAI semantic conventions' explicit bucket boundaries advice
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92]
TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                 16777216, 67108864]
# a layer's handling of one event: sub-millisecond to a stuck broker's seconds
HANDLE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0]


class Metrics:
    """One process's meter, and the Prometheus registry it is read through.
    ``enabled=False`` gives a no-op meter: instruments cost a call and nothing."""

    def __init__(self, service: str, enabled: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._provider: MeterProvider | None = None
        self._server: Any = None
        if enabled:
            reader = PrometheusMetricReader(registry=self.registry, scope_info_enabled=False)
            self._provider = MeterProvider(
                metric_readers=[reader],
                resource=Resource.create({"service.name": f"conveyor-{service}"}))
            self.meter: Meter = self._provider.get_meter("conveyor")
            ProcessCollector(registry=self.registry)
        else:
            self.meter = NoOpMeterProvider().get_meter("conveyor")

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def exposition(self) -> bytes:
        """Everything recorded so far, in the Prometheus text format."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> None:
        """Serve ``GET /metrics`` (any path, in fact) on ``host:port`` from a thread."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self._server = server

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
        if self._provider is not None:
            self._provider.shutdown()


def process_metrics(telemetry: TelemetrySettings, service: str) -> Metrics:
    """The metrics of a process that is not the gateway, as its settings say:
    served on ``metrics_port``, or a no-op meter when it is 0 or metrics are
    disabled."""
    port = telemetry.metrics_port if telemetry.metrics_enabled else 0
    metrics = Metrics(service, enabled=port > 0)
    if port > 0:
        metrics.serve(telemetry.metrics_host, port)
    return metrics


# -- the gateway -----------------------------------------------------------------


class GatewayMetrics:
    """What the gateway records as each request ends (``Answer`` closed)."""

    def __init__(self, meter: Meter) -> None:
        self._requests = meter.create_counter(
            "conveyor.gateway.requests", unit="{request}",
            description="Generation requests by HTTP status, model and tenant.")
        self._ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self._tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token generated after the first token for "
                        "successful responses.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self._duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="Generative AI server request duration such as time-to-last byte "
                        "or last output token.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self._tokens = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)

    @classmethod
    def off(cls) -> GatewayMetrics:
        """Instruments that record nothing (a gateway built without metrics)."""
        return cls(NoOpMeterProvider().get_meter("conveyor"))

    def request_ended(self, *, status: int, model: str, tenant: str, operation: str,
                      started: float, first_at: float | None, ended: float,
                      input_tokens: int | None, output_tokens: int | None) -> None:
        """One finished request; times are ``time.monotonic()`` readings.
        ``operation`` is ``chat`` or ``text_completion``."""
        self._requests.add(1, {"http.response.status_code": status,
                               "gen_ai.request.model": model, "conveyor.tenant": tenant,
                               "gen_ai.operation.name": operation})
        attrs: dict[str, str | int] = {"gen_ai.request.model": model,
                                       "gen_ai.operation.name": operation}
        if status != 200:
            self._duration.record(ended - started, {**attrs, "error.type": str(status)})
            return
        self._duration.record(ended - started, attrs)
        if first_at is not None:
            self._ttft.record(first_at - started, attrs)
            if output_tokens is not None and output_tokens > 1:
                self._tpot.record((ended - first_at) / (output_tokens - 1), attrs)
        if input_tokens is not None:
            self._tokens.record(input_tokens, {**attrs, "gen_ai.token.type": "input"})
        if output_tokens is not None:
            self._tokens.record(output_tokens, {**attrs, "gen_ai.token.type": "output"})


# -- layers ----------------------------------------------------------------------

LagSource = Callable[[], Iterable[tuple[int, int]]]


def _dead_letters(meter: Meter) -> Counter:
    """The dead-letter counter every layer (infer included) adds to."""
    return meter.create_counter("conveyor.layer.dead_letters", unit="{event}",
                                description="Events a layer sent to the dead-letter topic.")


@dataclass(frozen=True)
class LayerProbe:
    """One layer's instruments, with its attributes made once."""

    metrics: LayerMetrics
    attrs: Mapping[str, str]

    def handled(self, seconds: float) -> None:
        self.metrics.events.add(1, self.attrs)
        self.metrics.handle_duration.record(seconds, self.attrs)

    def dead_letter(self) -> None:
        self.metrics.dead_letters.add(1, self.attrs)


@dataclass
class LayerMetrics:
    """Events handled, handling time, dead letters and consumer lag, per layer;
    the layers of one process share it."""

    meter: Meter
    _lags: dict[str, LagSource] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.events = self.meter.create_counter(
            "conveyor.layer.events", unit="{event}", description="Events a layer handled.")
        self.handle_duration = self.meter.create_histogram(
            "conveyor.layer.handle.duration", unit="s",
            description="How long a layer took over one event (decode, handle, produce).",
            explicit_bucket_boundaries_advisory=HANDLE_BUCKETS)
        self.dead_letters = _dead_letters(self.meter)
        self.meter.create_observable_gauge(
            "conveyor.layer.consumer_lag", callbacks=[self._observe_lag], unit="{event}",
            description="Events in a partition's log that the layer has not taken yet.")

    @classmethod
    def off(cls) -> LayerMetrics:
        """Instruments that record nothing (a runtime built without metrics)."""
        return cls(NoOpMeterProvider().get_meter("conveyor"))

    def layer(self, name: str, lag: LagSource | None = None) -> LayerProbe:
        """The probe of layer ``name``; ``lag`` gives (partition, lag) pairs at a scrape."""
        if lag is not None:
            with self._lock:
                self._lags[name] = lag
        return LayerProbe(self, {"conveyor.layer": name})

    def _observe_lag(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            sources = list(self._lags.items())
        for name, source in sources:
            for partition, lag in source():
                yield Observation(lag, {"conveyor.layer": name, "messaging.destination."
                                        "partition.id": str(partition)})


def partition_lag(consumer: Any, next_offsets: Mapping[TopicPartition, int]
                  ) -> list[tuple[int, int]]:
    """(partition, highwater - next offset to take) for the partitions whose
    highwater the consumer knows. Read from a scrape thread: works on a copy,
    and a partition that moved away meanwhile is skipped."""
    out: list[tuple[int, int]] = []
    if consumer is None:
        return out
    for tp, next_offset in dict(next_offsets).items():
        try:
            high = consumer.highwater(tp)
        except Exception:  # not assigned any more (AssertionError), or mid-rebalance
            continue
        if high is not None:
            out.append((tp.partition, max(high - next_offset, 0)))
    return out


# -- infer workers ---------------------------------------------------------------

Load = Callable[[], tuple[int, int, int]]


class WorkerMetrics:
    """An infer worker's capacity, running generations and queued tasks, read
    at each scrape from ``load`` (capacity, running, queued), and its dead
    letters."""

    def __init__(self, meter: Meter, worker_id: str, pool: str, load: Load,
                 host_cache: Callable[[], Mapping[str, int] | None] | None = None) -> None:
        self._load = load
        self._attrs = {"conveyor.worker": worker_id, "conveyor.pool": pool}
        for index, (name, what) in enumerate((
                ("capacity", "Generations the engine runs at once."),
                ("running", "Generations running now."),
                ("queued", "Tasks in the worker's partitions not taken yet."))):
            meter.create_observable_gauge(f"conveyor.worker.{name}",
                                          callbacks=[self._observer(index)],
                                          unit="{request}", description=what)
        if host_cache is not None:
            self._host_cache_metrics(meter, host_cache)
        # infer is a layer of the pipeline: its dead letters are counted as the
        # other layers' are, under conveyor.layer="infer"
        self._dead_letters = _dead_letters(meter)
        self._layer = {"conveyor.layer": "infer", **self._attrs}

    def dead_letter(self) -> None:
        """The worker sent a task to the dead-letter topic."""
        self._dead_letters.add(1, self._layer)

    def _observer(self, index: int) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(self._load()[index], self._attrs)]
        return observe

    def _host_cache_metrics(self, meter: Meter,
                            stats: Callable[[], Mapping[str, int] | None]) -> None:
        """The llama.cpp engines' host-memory cache (``--host-cache-mib``), read at
        each scrape: what it holds, and what it saved, restored and evicted."""

        def observer(key: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
            def observe(options: CallbackOptions) -> Iterable[Observation]:
                now = stats()
                return [] if now is None else [Observation(now[key], self._attrs)]
            return observe

        meter.create_observable_gauge(
            "conveyor.worker.host_cache.size", callbacks=[observer("held_bytes")], unit="By",
            description="Bytes of KV cache the worker keeps in host memory.")
        meter.create_observable_gauge(
            "conveyor.worker.host_cache.entries", callbacks=[observer("entries")],
            unit="{sequence}", description="Sequences the worker keeps in host memory.")
        for name, what in (("saved", "copied out of a context that moved on"),
                           ("restored", "copied back for a prompt they served"),
                           ("evicted", "dropped for room")):
            meter.create_observable_counter(
                f"conveyor.worker.host_cache.{name}", callbacks=[observer(name)],
                unit="{sequence}", description=f"Sequences of the host cache {what}.")
