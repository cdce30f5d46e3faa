"""Conveyor's settings: one frozen object of sections, built once at start
and passed in; a component takes the section it reads.

Every setting has one flat name, its environment variable without the
``CONVEYOR_`` prefix (``CONVEYOR_KAFKA_BOOTSTRAP`` is ``kafka_bootstrap``,
read as ``settings.kafka.bootstrap``). :func:`load_settings` reads the
environment and takes explicit overrides by the same flat names; nothing reads
the environment at import time. ``docs/gen_config.py`` makes the configuration
reference from the sections below, their comments included.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

__all__ = ["AuthSettings", "GatewaySettings", "ImagesSettings", "InferSettings", "JobsSettings",
           "KafkaSettings",
           "PrefixSettings", "ProcessSettings", "RedisSettings", "ScheduleSettings", "Settings",
           "TelemetrySettings", "load_settings"]

_DEFAULT_MODELS = Path(__file__).with_name("models.toml")
ENV_PREFIX = "CONVEYOR_"


class Section(BaseModel):
    """A group of settings. A field's flat name is its alias where it has one
    (``bootstrap`` is ``kafka_bootstrap``), else its own name."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True,
                              validate_by_alias=True)
    title: ClassVar[str] = ""

    @classmethod
    def flat_names(cls) -> dict[str, str]:
        """flat name -> field name."""
        return {(info.alias or name): name for name, info in cls.model_fields.items()}


class TelemetrySettings(Section):
    title = "Telemetry"

    # the level of every process's log (DEBUG, INFO, WARNING, ERROR)
    log_level: str = "INFO"
    # none | console | otlp (see topics/tracing.py)
    trace_exporter: Literal["none", "console", "otlp"] = "none"
    # Prometheus metrics of layers, infer workers and accounting (see conveyor/metrics.py):
    # the port they are served on, 0 = none; the gateway serves /metrics on its own port
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # false: no process records or serves metrics (no /metrics on the gateway,
    # metrics_port ignored); what they cost: docs/decisions/0025-resumable-streams-and-metrics.md
    metrics_enabled: bool = True


class ProcessSettings(Section):
    title = "Processes"

    # once a serving process has started, what it built is frozen out of the cyclic
    # collector's scans and its youngest generation collects after this many
    # allocations (Python's own: 700); 0 leaves the collector alone (conveyor/heap.py)
    gc_threshold: int = 10_000
    # how much lower the accounting app's CPU priority is than the request
    # path's (os.nice, 0-19): where the gateway, the layers and the workers fill
    # the cores, the cold path waits and catches up from the log when they rest
    # (measured: docs/benchmarks/results/many-streams.md); 0 keeps them equal
    accounting_nice: int = Field(10, ge=0, le=19)
    # Background tasks (leases, heartbeats, followers) retry a failing Redis or
    # Kafka with exponential backoff up to this many seconds.
    retry_backoff_max_s: float = 5.0
    # How long a process waits at start for something it needs (the broker, its
    # consumer group, Redis) before it exits (code 3) saying what it waited for;
    # meanwhile it logs the wait every few seconds (conveyor/startup.py). 60 s:
    # a cold local broker answers within about 10 s and a group join takes
    # seconds (session timeouts of 1.5-6 s), so a minute is past any healthy
    # start and soon enough for a supervisor to restart and report. An engine
    # loading its model is logged but not bounded (minutes for a large model).
    startup_timeout_s: float = 60.0
    # how far clocks of different hosts may disagree: lookups of a request's
    # events by time start this much earlier, and a claim is trusted only for
    # tasks written this long after Redis was last seen to lose data
    clock_skew_ms: int = 2000
    # the model registry (route, preprocess and infer read it)
    models_file: Path = _DEFAULT_MODELS
    # a folder of schema versions (conveyor.<Type>.v<N>.avsc) a process reads
    # besides its own: in a rolling upgrade, the processes not upgraded yet are
    # given the new version's schemas and read the events of those that are,
    # where they would dead-letter them (docs/operating/log-tools.md)
    schema_history: Path | None = None


class KafkaSettings(Section):
    title = "Kafka"

    # the Kafka brokers every process connects to (host:port, comma-separated)
    bootstrap: str = Field("127.0.0.1:9092", alias="kafka_bootstrap")
    # Every topic and consumer group name starts with this; tests use their own.
    topic_prefix: str = "conveyor"
    # Producer: acks=all always; the idempotent producer can be switched off
    # for brokers that do not implement it.
    producer_idempotent: bool = True
    producer_linger_ms: int = 0
    # none by default: events are a few hundred bytes, where compression costs the
    # broker CPU for nothing on loopback; choose lz4 or zstd across slow links
    producer_compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = "none"
    # The largest event a topic takes (topic max.message.bytes, producer
    # max_request_size); the gateway refuses bodies that could not fit (413).
    max_event_bytes: int = 8 * 1024 * 1024
    # Replication of every topic Conveyor creates: 0 = as many brokers as the
    # cluster has, at most 3; min.insync.replicas 0 = 2 when replicated 3+, else 1.
    replication_factor: int = 0
    min_insync_replicas: int = 0
    # the layers' consumer groups: a member that sends no heartbeat for the session
    # timeout leaves its group and its partitions go to the others
    consumer_session_timeout_ms: int = 6000
    consumer_heartbeat_interval_ms: int = 1000
    # Partition counts of the catalog (see topics/catalog.py)
    pipeline_partitions: int = 4
    infer_partitions: int = 8
    reply_partitions: int = 8

    def topic(self, name: str) -> str:
        """The full name of a catalog topic (``requests`` -> ``conveyor.requests``)."""
        return f"{self.topic_prefix}.{name}"

    def group(self, layer: str) -> str:
        """The consumer group of a layer (``preprocess`` -> ``conveyor.preprocess``)."""
        return f"{self.topic_prefix}.{layer}"


class RedisSettings(Section):
    title = "Redis"

    # the Redis that holds keys, limits, leases and caches (never the only copy of anything)
    url: str = Field("redis://127.0.0.1:6379/0", alias="redis_url")
    # how long the console's request index keeps a finished request (its search
    # finds no older one): a row and five sorted-set entries, about 0.8 KiB a
    # request, so 10 requests a second kept 7 days is about 5 GiB of Redis; at
    # most the usage topic's 35 days, from which the accounting app rebuilds it
    request_index_days: float = Field(default=7.0, gt=0, le=35)


class GatewaySettings(Section):
    title = "Gateway"

    # the address the gateway listens on
    host: str = Field("127.0.0.1", alias="gateway_host")
    port: int = Field(8000, alias="gateway_port")
    # empty: a random id per process
    id: str = Field("", alias="gateway_id")
    # a gateway's lease on its reply partitions (renewed every third of it); a
    # gateway gone this long frees them for another
    reply_lease_ttl_s: float = 15.0
    # the deadline of a request from its arrival: past it the client gets a timeout error
    request_timeout_s: float = 300.0
    # an SSE stream with nothing to send writes a comment this often, so proxies keep it
    sse_keepalive_s: float = 10.0
    # how long a streaming client that dropped may take to resume its stream
    # (GET .../{id}/stream, on any replica) before its generation is cancelled
    resume_grace_s: float = 5.0
    # false: SSE events carry no ids and a dropped client's generation is
    # cancelled at once (resume_grace_s unused); GET .../{id}/stream still
    # replays a stream from its start
    resumable_streams: bool = True
    # how long the gateway waits for Kafka to take a request (503 after it)
    produce_timeout_s: float = 5.0
    # The largest request body the gateway accepts (413 above it); it must fit,
    # with the pipeline's additions, in one event of max_event_bytes.
    max_body_bytes: int = 2 * 1024 * 1024


class AuthSettings(Section):
    title = "Auth"

    # none | keys (API keys in Redis) | jwt (signed bearer tokens) (gateway/auth).
    # With none the gateway binds only to loopback unless insecure_no_auth is set.
    mode: Literal["none", "keys", "jwt"] = Field("none", alias="auth")
    insecure_no_auth: bool = False
    # the server secret API keys are hashed with (HMAC-SHA-256); needed by auth=keys
    # and by `conveyor keys`; changing it invalidates every key
    secret: SecretStr = Field(SecretStr(""), alias="auth_secret")
    # how long a gateway trusts a key it looked up (revocations arrive at once by
    # pub/sub; this only bounds a missed message)
    key_cache_s: float = 30.0
    # jwt: HS256 with jwt_secret, or RS256/ES256 with the keys of a JWKS file
    jwt_secret: SecretStr = SecretStr("")
    jwt_jwks_file: Path | None = None
    jwt_audience: str = ""
    jwt_issuer: str = ""
    jwt_tenant_claim: str = "tenant"
    jwt_leeway_s: float = 5.0
    # when Redis cannot be reached, limits are enforced by each gateway on its own
    # share of every limit (share) or refused with 503 (closed)
    limits_when_redis_down: Literal["share", "closed"] = "share"
    # bearer token of the operator endpoints (/admin/usage); empty: they do not exist
    admin_token: SecretStr = SecretStr("")


class JobsSettings(Section):
    title = "Files and batches"

    # where uploaded files (batch input) and batch output are kept
    files_dir: Path = Path(".conveyor/files")
    max_file_bytes: int = 100 * 1024 * 1024
    batch_max_lines: int = 50_000


class ImagesSettings(Section):
    title = "Images"

    # image parts of chat messages (docs/api/chat.md#images): at most max_count in
    # a request, each at most max_bytes once decoded and max_pixels (width times
    # height); kept once in the file store (jobs.files_dir), events carry their ids
    max_bytes: int = Field(8 * 1024 * 1024, alias="images_max_bytes", ge=1)
    max_count: int = Field(8, alias="images_max_count", ge=0)
    max_pixels: int = Field(25_000_000, alias="images_max_pixels", ge=1)
    # the largest body POST /v1/chat/completions and /v1/responses accept (other
    # routes keep gateway.max_body_bytes): room for images sent as data URLs,
    # which the gateway stores before anything enters the pipeline
    max_body_bytes: int = Field(20 * 1024 * 1024, alias="images_max_body_bytes", ge=1)
    # hosts whose http(s) image URLs the gateway fetches ("images.example.com,cdn.example.org";
    # empty: none, only data URLs are taken): a host alone at its scheme's default
    # port (80, 443), "host:port" at that port; only at public addresses unless
    # allow_private_addresses (an image server inside the operator's network, or
    # a test's on loopback); the fetches of a request bounded by fetch_timeout_s
    allowed_hosts: str = Field("", alias="images_allowed_hosts")
    allow_private_addresses: bool = Field(False, alias="images_allow_private_addresses")
    fetch_timeout_s: float = Field(10.0, alias="images_fetch_timeout_s", gt=0)
    # an image not sent again for this many days is deleted from the file store:
    # longer than any topic keeps an event that names it (conveyor.dlq and
    # conveyor.jobs keep 30 days), so a replay or a redrive finds it
    retention_days: float = Field(31.0, alias="images_retention_days", gt=0)

    def hosts(self) -> frozenset[str]:
        return frozenset(h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip())


class ScheduleSettings(Section):
    title = "Schedule"

    # a task whose pool has had no live worker this long is refused
    # (no_worker_available)
    no_worker_timeout_s: float = 10.0
    # an interactive task waits in schedule for a worker with room (a free slot
    # and KV for its prompt plus max_tokens) at most schedule_timeout_s, then is
    # refused with 503 and Retry-After; past schedule_queue_max tasks of one
    # tenant waiting in a pool, at once (workers/schedule/room.py); the waiting
    # tasks of a pool take turns between tenants (workers/schedule/layer.py)
    timeout_s: float = Field(5.0, alias="schedule_timeout_s")
    queue_max: int = Field(256, alias="schedule_queue_max")
    # fair shares of a pool (workers/schedule/layer.py): a tenant that sent an
    # interactive task to a pool within fair_window_s is present there (0: off);
    # a tenant running its share of the pool's slots (rounded up) or more leaves
    # one free slot to each other present tenant under its own share, until its
    # task would be refused; shares are equal but for the weights of
    # tenant_shares ("acme=3,beta=0.5"; a tenant not named weighs 1)
    fair_window_s: float = Field(5.0, alias="schedule_fair_window_s")
    tenant_shares: str = Field("", alias="schedule_tenant_shares")
    # a worker counts as live while its last heartbeat is younger than this
    worker_ttl_s: float = 3.0
    # the share of a pool's capacity batch work may hold; the rest stays free for
    # interactive requests (batch still uses everything when nothing else waits)
    batch_max_share: float = 0.75
    # batch tasks a worker may hold queued beyond its free slots (0: finishes are
    # seen within milliseconds, so a freed slot is refilled without one)
    batch_prefetch: int = 0
    # interactive traffic counts as present this long after its last task was sent
    interactive_linger_s: float = 2.0
    # Prefix-aware routing (workers/prefix.py): schedule remembers which worker
    # took which blocks (route_index_blocks a worker, for route_index_ttl_s) and
    # sends a prompt to the worker likely to hold most of it, when one holds
    # route_cache_threshold of it, among the workers under route_load_bound times
    # the pool's mean load or route_load_slack of their own capacity; a whole
    # prompt in cache is worth route_load_weight of a worker's load (busy / capacity)
    route_prefix_aware: bool = True
    route_cache_threshold: float = 0.3
    route_load_bound: float = 1.25
    route_load_weight: float = 1.0
    route_load_slack: float = 0.5
    route_index_blocks: int = 4096
    route_index_ttl_s: float = 600.0
    # a worker whose engine fails breaker_failures times in a row gets no new
    # work for breaker_cooldown_s, then one probe task decides (workers/schedule/breakers.py)
    breaker_failures: int = 3
    breaker_cooldown_s: float = 30.0
    # a task whose engine fails before its first token goes to schedule again,
    # for another worker (or a fallback model), at most this many times
    engine_retries: int = 2

    @field_validator("tenant_shares")
    @classmethod
    def _shares_read(cls, text: str) -> str:
        tenant_weights(text)
        return text

    def weights(self) -> dict[str, float]:
        """``tenant_shares`` read: tenant -> weight."""
        return tenant_weights(self.tenant_shares)


def tenant_weights(text: str) -> dict[str, float]:
    """``"acme=3,beta=0.5"`` -> {"acme": 3.0, "beta": 0.5}; a ValueError names
    what is wrong."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, sep, weight = item.partition("=")
        try:
            value = float(weight) if sep and tenant.strip() else -1.0
        except ValueError:
            value = -1.0
        if not value > 0 or value == float("inf"):
            raise ValueError(f"tenant share {item!r}: want tenant=weight, a weight above 0")
        weights[tenant.strip()] = value
    return weights


class PrefixSettings(Section):
    title = "Prefix caches"

    # preprocess hashes each prompt's first prefix_max_blocks whole blocks of
    # prefix_block_tokens tokens (workers/prefix.py); schedule routes by them
    block_tokens: int = Field(64, alias="prefix_block_tokens")
    max_blocks: int = Field(256, alias="prefix_max_blocks")
    # a worker reports the blocks its KV cache holds (at most this many, the most
    # recently used) in each heartbeat; 0: it reports none, schedule guesses
    report_blocks: int = Field(1024, alias="prefix_report_blocks")
    # every tenant's prompts reuse every other's cached prefixes (the engines'
    # KV caches, the llama.cpp host cache, schedule's prefix index): for a
    # deployment that serves one organisation. Off, a tenant reuses only its own,
    # so usage.prompt_tokens_details.cached_tokens and timing reveal nothing of
    # another tenant's prompts (workers/prefix.py)
    cache_shared: bool = Field(False, alias="prefix_cache_shared")


class InferSettings(Section):
    title = "Infer workers"

    # the bearer token an infer worker's openai engine sends its upstream
    # (--engine openai), from the environment only: a command line is visible to
    # every user of the host; empty: no Authorization header
    upstream_api_key: SecretStr = SecretStr("")

    # a worker's heartbeat (its load, KV and cached blocks) every this many seconds
    heartbeat_interval_s: float = 1.0
    # a streamed answer's tokens are gathered at most this long into one chunk event:
    # the window is this times 1 - 1/streams, the streams its worker runs (a stream
    # alone gets each piece at once; workers/infer/generation.py)
    coalesce_ms: float = 40.0
    # while the worker's ticks run late (its process, or the machine, short of
    # CPU), the window widens up to coalesce_max_ms, and narrows back as they
    # run on time: fewer, fuller chunks where every chunk costs (0: never widens)
    coalesce_max_ms: float = 66.0
    # A client that does not stream sees no chunk cadence: its chunks are only
    # the checkpoints a retry continues from, so they are gathered for longer.
    coalesce_unstreamed_ms: float = 250.0
    # how long Redis keeps a task's claim and its finished mark (seconds): a
    # redelivered task past it finds no claim and is judged from the log
    progress_ttl_s: int = 3600
    # how long a dead worker's task stays leased to it (renewed every fifth):
    # with the infer group's session timeout, this bounds how long a dead
    # worker's streams stall before a survivor continues them
    claim_lease_s: float = 2.0
    # infer workers leave their group this soon after they stop heartbeating
    # (SIGKILL): a survivor takes their partitions over within about this time
    session_timeout_ms: int = Field(1500, alias="infer_session_timeout_ms")
    heartbeat_interval_ms: int = Field(300, alias="infer_heartbeat_interval_ms")


class Settings(BaseModel):
    """Every section; ``settings.kafka`` is what a Kafka client needs, and so on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    telemetry: TelemetrySettings = TelemetrySettings.model_validate({})
    process: ProcessSettings = ProcessSettings.model_validate({})
    kafka: KafkaSettings = KafkaSettings.model_validate({})
    redis: RedisSettings = RedisSettings.model_validate({})
    gateway: GatewaySettings = GatewaySettings.model_validate({})
    auth: AuthSettings = AuthSettings.model_validate({})
    jobs: JobsSettings = JobsSettings.model_validate({})
    images: ImagesSettings = ImagesSettings.model_validate({})
    schedule: ScheduleSettings = ScheduleSettings.model_validate({})
    prefix: PrefixSettings = PrefixSettings.model_validate({})
    infer: InferSettings = InferSettings.model_validate({})

    SECTIONS: ClassVar[dict[str, type[Section]]]
    FLAT: ClassVar[dict[str, tuple[str, str]]]

    @classmethod
    def from_flat(cls, values: Mapping[str, object]) -> Settings:
        """Settings from flat names (``kafka_bootstrap``); unknown names raise."""
        unknown = sorted(set(values) - cls.FLAT.keys())
        if unknown:
            raise TypeError(f"unknown settings: {', '.join(unknown)}")
        parts: dict[str, dict[str, object]] = {name: {} for name in cls.SECTIONS}
        for flat, value in values.items():
            section, _ = cls.FLAT[flat]
            parts[section][flat] = value
        return cls.model_validate({name: cls.SECTIONS[name].model_validate(part)
                                   for name, part in parts.items()})

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        out: dict[str, Any] = {}
        for name in self.SECTIONS:
            out.update(getattr(self, name).model_dump(by_alias=True))
        return out

    def replace(self, **flat: object) -> Settings:
        """A copy with some settings changed, by flat name, validated."""
        return self.from_flat({**self.flat(), **flat})


Settings.SECTIONS = {name: info.annotation for name, info in Settings.model_fields.items()
                     if isinstance(info.annotation, type) and issubclass(info.annotation, Section)}
Settings.FLAT = {flat: (section, field) for section, cls in Settings.SECTIONS.items()
                 for flat, field in cls.flat_names().items()}


def load_settings(**overrides: object) -> Settings:
    """The settings of the environment (``CONVEYOR_<FLAT NAME>``), with
    explicit overrides by flat name on top."""
    values: dict[str, object] = {}
    for key, value in os.environ.items():
        flat = key[len(ENV_PREFIX):].lower()
        if key.upper().startswith(ENV_PREFIX) and flat in Settings.FLAT:
            values[flat] = value
    return Settings.from_flat({**values, **overrides})
