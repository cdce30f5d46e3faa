"""The topics, declared once: each a :class:`Topic` with its name under the
prefix, the event types it carries (``Topic[T]``: :meth:`Topic.decode`
returns a ``T``), its key, partitions and retention. Readers and writers name
a topic by its object (``TOKENS.at(settings.kafka)``), never a string. Every
topic takes events up to ``max_event_bytes``, the producers' own limit.
The table: docs/architecture.md#topics.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Generic, Literal, TypeVar, cast

from conveyor.settings import KafkaSettings
from schemas.codec import Codec, EventType
from schemas.records import (
    ApiKey,
    AuditEvent,
    BreakerState,
    Control,
    DeadLetter,
    Feedback,
    JobCommand,
    JobResult,
    JobStatus,
    ModelRegistry,
    PolicyDocument,
    Prepared,
    Reply,
    ReplyBatch,
    Request,
    Task,
    TenantPolicy,
    TokenBatch,
    TokenChunk,
    UsageRecord,
    WorkerHeartbeat,
)

__all__ = ["Topic", "TopicSpec", "TOPICS", "catalog", "infer_topic", "topic_named", "INFER",
           "REQUESTS", "PREPARED", "ROUTED", "TOKENS", "REPLIES", "CONTROL", "WORKERS", "JOBS",
           "JOB_STATUS", "RESULTS", "DLQ", "FEEDBACK", "USAGE", "AUDIT", "KEYS", "BREAKERS",
           "MODELS"]

_DAY_MS = 24 * 3600 * 1000

Sizing = Literal["pipeline", "replies", "one"]
T = TypeVar("T")


@dataclass(frozen=True)
class Topic(Generic[T]):
    """One topic of the catalog (the pools' task topics are :func:`infer_topic`),
    typed by the event it carries: ``Topic[Task]``."""

    name: str  # under the prefix: kafka.topic(name)
    types: tuple[type[T], ...]  # the typed mirrors of what travels on it
    key: str
    sizing: Sizing = "pipeline"  # pipeline_partitions, reply_partitions, or 1
    cleanup: Literal["delete", "compact"] = "delete"
    retention_ms: int = _DAY_MS
    # records that hold many requests' events: the record's type and its list
    # field (docs/decisions/0032-many-streams-a-record.md)
    batch: tuple[type[Any], str] | None = None

    @property
    def events(self) -> tuple[EventType, ...]:
        """The Avro names of what its records decode as (a mirror is named as its
        schema): its events' types, or its batch's."""
        types = self.types if self.batch is None else (self.batch[0],)
        return tuple(cast(EventType, t.__name__) for t in types)

    @property
    def handled(self) -> tuple[EventType, ...]:
        """The Avro names of the events a reader handles (a batch's items)."""
        return tuple(cast(EventType, t.__name__) for t in self.types)

    def decode(self, codec: Codec, value: bytes | None) -> T:
        """One value of this topic as its event; SchemaError for anything else."""
        if self.batch is not None:
            raise TypeError(f"{self.name}: a record holds many events: unpack() it")
        return cast(T, codec.decode(value, self.events))

    def unpack(self, codec: Codec, value: bytes | None) -> list[T]:
        """The events one value holds, in order: itself, or a batch's."""
        event = codec.decode(value, self.events)
        return [event] if self.batch is None else list(event[self.batch[1]])

    def pack(self, events: list[T]) -> Any:
        """The batch record holding ``events`` (a topic of batches only)."""
        if self.batch is None:
            raise TypeError(f"{self.name} holds one event a record")
        return {self.batch[1]: events}

    def encode(self, codec: Codec, event: T, event_type: EventType | None = None) -> bytes:
        """``event`` in the encoding of its type (named when the topic carries several)."""
        if event_type is None:
            if len(self.types) != 1:
                raise ValueError(f"{self.name} carries {self.events}: name the event type")
            event_type = self.events[0]
        return codec.encode(event_type, cast(Any, event))

    def at(self, kafka: KafkaSettings) -> str:
        """The topic's full name under the topic prefix."""
        return kafka.topic(self.name)

    def partitions(self, kafka: KafkaSettings) -> int:
        return {"pipeline": kafka.pipeline_partitions,
                "replies": kafka.reply_partitions, "one": 1}[self.sizing]

    def spec(self, kafka: KafkaSettings) -> TopicSpec:
        return TopicSpec(self.at(kafka), self.partitions(kafka), key=self.key,
                         cleanup=self.cleanup, retention_ms=self.retention_ms,
                         max_message_bytes=kafka.max_event_bytes)


REQUESTS = Topic("requests", (Request,), "request id")
PREPARED = Topic("prepared", (Prepared,), "request id")
ROUTED = Topic("routed", (Task,), "request id")
TOKENS = Topic("tokens", (TokenChunk,), "none: a record holds the chunks of the requests whose "
               "id's partition it is in, named in its request-ids header",
               batch=(TokenBatch, "chunks"))
REPLIES = Topic("replies", (Reply,),
                "none: a record holds replies bound for one gateway, its leased reply "
                "partition, naming their requests in its request-ids header", "replies",
                batch=(ReplyBatch, "replies"))
CONTROL = Topic("control", (Control,), "request id", "one")
WORKERS = Topic("workers", (WorkerHeartbeat,), "worker id", "one", "compact", -1)
# jobs: commands in, the latest state of each job, and each request's result
JOBS = Topic("jobs", (JobCommand,), "job id", retention_ms=30 * _DAY_MS)
JOB_STATUS = Topic("job-status", (JobStatus,), "job id", "one", "compact", -1)
RESULTS = Topic("results", (JobResult,), "job id", retention_ms=30 * _DAY_MS)
DLQ = Topic("dlq", (DeadLetter,), "original key", "one", retention_ms=30 * _DAY_MS)
FEEDBACK = Topic("feedback", (Feedback,), "request id", "one", retention_ms=30 * _DAY_MS)
# one UsageRecord per finished request; the accounting app aggregates it
USAGE = Topic("usage", (UsageRecord,), "tenant", retention_ms=35 * _DAY_MS)
AUDIT = Topic("audit", (AuditEvent,), "tenant (or actor)", "one",
              retention_ms=365 * _DAY_MS)
# the record of API keys and tenant policies; Redis holds a copy to look up
KEYS: Topic[ApiKey | TenantPolicy] = Topic("keys", (ApiKey, TenantPolicy),
                                           "key id, or tenant:<name>", "one", "compact", -1)

# schedule's circuit breaker of each worker, written at every change of state
BREAKERS = Topic("breakers", (BreakerState,), "worker id", "one", "compact", -1)
# the model registry `conveyor models apply` published; every process follows it
MODELS = Topic("models", (ModelRegistry,), "\"registry\"", "one", "compact", -1)
# content policies `conveyor policies set` published (conveyor/policy); every process follows it
POLICIES = Topic("policies", (PolicyDocument,), "the scope: default, tenant:<name>, key:<id>",
                 "one", "compact", -1)

# every pool's task topic carries what schedule writes (infer_topic names one)
INFER = Topic("infer.<pool>", (Task,), "request id; partition = the chosen worker's")

TOPICS: tuple[Topic[Any], ...] = (REQUESTS, PREPARED, ROUTED, TOKENS, REPLIES, CONTROL, WORKERS,
                             JOBS, JOB_STATUS, RESULTS, DLQ, FEEDBACK, USAGE, AUDIT, KEYS,
                             BREAKERS, MODELS, POLICIES)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    key: str
    cleanup: Literal["delete", "compact"] = "delete"
    retention_ms: int = _DAY_MS
    extra: dict[str, str] = field(default_factory=dict)
    max_message_bytes: int | None = None

    def configs(self) -> dict[str, str]:
        out = {"cleanup.policy": self.cleanup, "retention.ms": str(self.retention_ms)}
        if self.max_message_bytes is not None:
            out["max.message.bytes"] = str(self.max_message_bytes)
        if self.cleanup == "compact":
            out.update({"min.cleanable.dirty.ratio": "0.1", "segment.ms": "600000"})
        out.update(self.extra)
        return out


def topic_named(kafka: KafkaSettings, name: str) -> Topic[Any] | None:
    """The catalog's topic whose full name under the topic prefix is ``name``."""
    return next((topic for topic in TOPICS if topic.at(kafka) == name), None)


def infer_topic(kafka: KafkaSettings, pool: str) -> str:
    """The task topic of one worker pool; its partitions are spread over the pool's workers."""
    return kafka.topic(f"infer.{pool}")


def catalog(kafka: KafkaSettings, pools: tuple[str, ...] = ()) -> list[TopicSpec]:
    """Every topic Conveyor uses, with the pools' task topics."""
    specs = [topic.spec(kafka) for topic in TOPICS]
    for pool in pools:
        specs.append(TopicSpec(infer_topic(kafka, pool), kafka.infer_partitions,
                               key=INFER.key))
    return [replace(s, max_message_bytes=kafka.max_event_bytes) for s in specs]
