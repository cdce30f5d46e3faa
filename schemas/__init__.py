"""Avro schemas for every Conveyor event, their typed mirrors, and the codec.

Declarative: nothing here imports a web framework, an engine or a Kafka client.
"""

from schemas.codec import Codec, EventType, default_codec
from schemas.records import (
    ApiKey,
    AuditEvent,
    ChunkHeader,
    Control,
    DeadLetter,
    Envelope,
    ErrorInfo,
    Generation,
    JobCommand,
    JobResult,
    JobStatus,
    Message,
    Prepared,
    Prompt,
    Reply,
    Request,
    Route,
    Sampling,
    Task,
    TenantPolicy,
    TokenBatch,
    TokenChunk,
    Usage,
    UsageRecord,
    WorkerHeartbeat,
)

__all__ = ["Codec", "EventType", "default_codec", "ChunkHeader", "Control", "DeadLetter",
           "Envelope", "ErrorInfo", "Generation", "JobCommand", "JobResult", "JobStatus",
           "Message", "Prepared", "Prompt", "Reply", "Request", "Route", "Sampling", "Task",
           "TokenBatch", "TokenChunk", "Usage", "WorkerHeartbeat", "UsageRecord", "AuditEvent",
           "ApiKey",
           "TenantPolicy"]
