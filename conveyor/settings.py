"""One frozen settings object, built once at start and passed in.

Every field can be set from the environment with the ``CONVEYOR_`` prefix
(``CONVEYOR_KAFKA_BOOTSTRAP=127.0.0.1:9092``). Nothing reads the environment
at import time: :func:`load_settings` is called by the CLI and by tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "load_settings"]

_DEFAULT_MODELS = Path(__file__).with_name("models.toml")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", frozen=True, extra="ignore")

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
    # once a serving process has started, what it built is frozen out of the cyclic
    # collector's scans and its youngest generation collects after this many
    # allocations (Python's own: 700); 0 leaves the collector alone (conveyor/heap.py)
    gc_threshold: int = 10_000

    # Services
    # the Kafka brokers every process connects to (host:port, comma-separated)
    kafka_bootstrap: str = "127.0.0.1:9092"
    # the Redis that holds keys, limits, leases and caches (never the only copy of anything)
    redis_url: str = "redis://127.0.0.1:6379/0"
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

    # the layers' consumer groups: a member that sends no heartbeat for the session
    # timeout leaves its group and its partitions go to the others
    consumer_session_timeout_ms: int = 6000
    consumer_heartbeat_interval_ms: int = 1000

    # Partition counts of the catalog (see topics/catalog.py)
    pipeline_partitions: int = 4
    infer_partitions: int = 8
    reply_partitions: int = 8

    # Gateway: the address it listens on
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    gateway_id: str = ""  # empty: a random id per process
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

    # Auth (gateway/auth): none | keys (API keys in Redis) | jwt (signed bearer tokens).
    # With none the gateway binds only to loopback unless insecure_no_auth is set.
    auth: Literal["none", "keys", "jwt"] = "none"
    insecure_no_auth: bool = False
    # the server secret API keys are hashed with (HMAC-SHA-256); needed by auth=keys
    # and by `conveyor keys`; changing it invalidates every key
    auth_secret: SecretStr = SecretStr("")
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

    # Jobs: files (batch input and output), batches and background responses
    files_dir: Path = Path(".conveyor/files")
    max_file_bytes: int = 100 * 1024 * 1024
    batch_max_lines: int = 50_000
    # the share of a pool's capacity batch work may hold; the rest stays free for
    # interactive requests (batch still uses everything when nothing else waits)
    batch_max_share: float = 0.75
    # batch tasks a worker may hold queued beyond its free slots (0: finishes are
    # seen within milliseconds, so a freed slot is refilled without one)
    batch_prefetch: int = 0
    # interactive traffic counts as present this long after its last task was sent
    interactive_linger_s: float = 2.0

    # Schedule: a task whose pool has had no live worker this long is refused
    # (no_worker_available)
    no_worker_timeout_s: float = 10.0
    # an interactive task waits in schedule for a worker with room (a free slot
    # and KV for its prompt plus max_tokens) at most schedule_timeout_s, then is
    # refused with 503 and Retry-After; past schedule_queue_max tasks of a pool
    # waiting, at once (workers/schedule/room.py)
    schedule_timeout_s: float = 5.0
    schedule_queue_max: int = 256
    # a worker counts as live while its last heartbeat is younger than this
    worker_ttl_s: float = 3.0
    # Prefix-aware routing (workers/prefix.py): preprocess hashes each prompt's
    # first prefix_max_blocks whole blocks of prefix_block_tokens tokens; schedule
    # remembers which worker took which blocks (route_index_blocks a worker, for
    # route_index_ttl_s) and sends a prompt to the worker likely to hold most of
    # it, when one holds route_cache_threshold of it, among the workers under
    # route_load_bound times the pool's mean load or route_load_slack of their
    # own capacity; a whole prompt in cache is worth route_load_weight of a
    # worker's load (busy / capacity)
    prefix_block_tokens: int = 64
    prefix_max_blocks: int = 256
    route_prefix_aware: bool = True
    route_cache_threshold: float = 0.3
    route_load_bound: float = 1.25
    route_load_weight: float = 1.0
    route_load_slack: float = 0.5
    route_index_blocks: int = 4096
    # a worker reports the blocks its KV cache holds (at most this many, the most
    # recently used) in each heartbeat; 0: it reports none, schedule guesses
    prefix_report_blocks: int = 1024
    route_index_ttl_s: float = 600.0
    # every tenant's prompts reuse every other's cached prefixes (the engines'
    # KV caches, the llama.cpp host cache, schedule's prefix index): for a
    # deployment that serves one organisation. Off, a tenant reuses only its own,
    # so usage.prompt_tokens_details.cached_tokens and timing reveal nothing of
    # another tenant's prompts (workers/prefix.py)
    prefix_cache_shared: bool = False
    # a worker whose engine fails breaker_failures times in a row gets no new
    # work for breaker_cooldown_s, then one probe task decides (workers/schedule/breakers.py)
    breaker_failures: int = 3
    breaker_cooldown_s: float = 30.0
    # a task whose engine fails before its first token goes to schedule again,
    # for another worker (or a fallback model), at most this many times
    engine_retries: int = 2

    # Infer: a worker's heartbeat (its load, KV and cached blocks) every this many seconds
    heartbeat_interval_s: float = 1.0
    # a streamed answer's tokens are gathered this long into one chunk event
    coalesce_ms: float = 40.0
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
    infer_session_timeout_ms: int = 1500
    infer_heartbeat_interval_ms: int = 300
    # how far clocks of different hosts may disagree: lookups of a request's
    # events by time start this much earlier, and a claim is trusted only for
    # tasks written this long after Redis was last seen to lose data
    clock_skew_ms: int = 2000

    # Model registry (route, preprocess and infer read it)
    models_file: Path = _DEFAULT_MODELS

    def topic(self, name: str) -> str:
        """The full name of a catalog topic (``requests`` -> ``conveyor.requests``)."""
        return f"{self.topic_prefix}.{name}"

    def group(self, layer: str) -> str:
        """The consumer group of a layer (``preprocess`` -> ``conveyor.preprocess``)."""
        return f"{self.topic_prefix}.{layer}"


def load_settings(**overrides: object) -> Settings:
    """Build the settings from the environment, with explicit overrides on top."""
    return Settings(**overrides)  # type: ignore[arg-type]
