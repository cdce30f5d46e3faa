"""The topic catalog in code (docs/architecture.md lists it): name, partitions,
retention, cleanup, key.

Every topic takes events up to ``settings.max_event_bytes``
(``max.message.bytes``), the same limit the producers enforce
(``max_request_size``, topics/clients.py): an event is refused by the
producer, which says so at once, before the broker would refuse it after a
round trip, and the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from conveyor.settings import Settings

__all__ = ["TopicSpec", "catalog", "infer_topic"]

_DAY_MS = 24 * 3600 * 1000


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


def infer_topic(settings: Settings, pool: str) -> str:
    """The task topic of one worker pool; its partitions are spread over the pool's workers."""
    return settings.topic(f"infer.{pool}")


def catalog(settings: Settings, pools: tuple[str, ...] = ()) -> list[TopicSpec]:
    """Every topic Conveyor uses, with the pools' task topics."""
    p = settings.pipeline_partitions
    specs = [
        TopicSpec(settings.topic("requests"), p, key="request id"),
        TopicSpec(settings.topic("prepared"), p, key="request id"),
        TopicSpec(settings.topic("routed"), p, key="request id"),
        TopicSpec(settings.topic("tokens"), p, key="request id"),
        TopicSpec(settings.topic("replies"), settings.reply_partitions,
                  key="request id; partition = the gateway's leased reply partition"),
        TopicSpec(settings.topic("control"), 1, key="request id"),
        TopicSpec(settings.topic("workers"), 1, key="worker id", cleanup="compact",
                  retention_ms=-1),
        # jobs: commands in, the latest state of each job, and each request's result
        TopicSpec(settings.topic("jobs"), p, key="job id", retention_ms=30 * _DAY_MS),
        TopicSpec(settings.topic("job-status"), 1, key="job id", cleanup="compact",
                  retention_ms=-1),
        TopicSpec(settings.topic("results"), p, key="job id", retention_ms=30 * _DAY_MS),
        TopicSpec(settings.topic("dlq"), 1, key="original key", retention_ms=30 * _DAY_MS),
        TopicSpec(settings.topic("feedback"), 1, key="request id", retention_ms=30 * _DAY_MS),
        # one UsageRecord per finished request; the accounting app aggregates it
        TopicSpec(settings.topic("usage"), p, key="tenant", retention_ms=35 * _DAY_MS),
        TopicSpec(settings.topic("audit"), 1, key="tenant (or actor)",
                  retention_ms=365 * _DAY_MS),
        # the record of API keys and tenant policies; Redis holds a copy to look up
        TopicSpec(settings.topic("keys"), 1, key="key id, or tenant:<name>", cleanup="compact",
                  retention_ms=-1),
    ]
    for pool in pools:
        specs.append(TopicSpec(infer_topic(settings, pool), settings.infer_partitions,
                               key="request id; partition = the chosen worker's"))
    return [replace(s, max_message_bytes=settings.max_event_bytes) for s in specs]
