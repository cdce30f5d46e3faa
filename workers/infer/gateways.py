"""Whether the gateway a generation answers is still alive.

When the reply-partition lease of a generation's gateway
(``{prefix}:reply-lease:{partition}``, gateway/replies.py) has been gone, or
held by another gateway, for a whole lease period, nobody can receive the
answer and the generation is cancelled; a lease back within the period
clears it. A generation whose stream a client resumed elsewhere runs on while
``{prefix}:resume-watch:{request id}`` exists (gateway/cancels.py).
"""

from __future__ import annotations

import logging
import time

from conveyor.redis_clients import Redis, reply_lease_key, text
from conveyor.settings import Settings
from workers.infer.generation import TaskRun

__all__ = ["GatewayWatch"]

log = logging.getLogger(__name__)


class GatewayWatch:
    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        # (gateway id, reply partition) -> when its lease was first seen missing
        self.gone_since: dict[tuple[str, int], float] = {}

    async def check(self, runs: list[TaskRun]) -> None:
        """Cancel the runs whose gateway's lease has been gone a whole period."""
        addresses = {(r.task["envelope"]["reply_gateway"], r.task["envelope"]["reply_partition"])
                     for r in runs}
        addresses = {a for a in addresses if a[0] and a[1] >= 0}
        for address in list(self.gone_since):
            if address not in addresses:
                del self.gone_since[address]
        if not addresses:
            return
        ordered = sorted(addresses)
        holders = await self.redis.mget(
            [reply_lease_key(self.settings.kafka.topic_prefix, p) for _, p in ordered])
        now = time.monotonic()
        gone: set[tuple[str, int]] = set()
        for (gateway, partition), holder in zip(ordered, holders, strict=True):
            if holder is not None and text(holder) == gateway:
                self.gone_since.pop((gateway, partition), None)
                continue
            since = self.gone_since.setdefault((gateway, partition), now)
            if now - since >= self.settings.gateway.reply_lease_ttl_s:
                gone.add((gateway, partition))
        orphans = [r for r in runs if (r.task["envelope"]["reply_gateway"],
                                       r.task["envelope"]["reply_partition"]) in gone]
        watched = await self.redis.mget(
            [f"{self.settings.kafka.topic_prefix}:resume-watch:{r.request_id}" for r in orphans]
        ) if orphans else []
        for run, watcher in zip(orphans, watched, strict=True):
            envelope = run.task["envelope"]
            if watcher is None:
                if not run.cancelled:
                    log.info("cancelling %s: its gateway %s is gone", run.request_id,
                             envelope["reply_gateway"])
                run.cancelled = True
