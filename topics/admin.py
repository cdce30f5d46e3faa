"""Creates the catalog's topics idempotently at start, replicated as the
cluster allows: the replication factor and ``min.insync.replicas`` come from
the settings, 0 meaning "choose from the cluster" (as many replicas as
brokers, at most 3; min.insync 2 once 3 replicas, else 1), set on each topic.
An existing topic replicated less than asked is reported at WARNING.
Operators' view: docs/operating/processes.md#replication.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    TopicAlreadyExistsError,
    for_code,
)

from conveyor.errors import BrokerError, ConveyorError, PermanentBrokerError
from conveyor.settings import Settings
from conveyor.startup import kafka_address, started
from topics.backoff import Backoff
from topics.catalog import TopicSpec

__all__ = ["Replication", "choose_replication", "ensure_topics", "drop_topics"]

log = logging.getLogger(__name__)

_AUTO_MAX_REPLICAS = 3


@dataclass(frozen=True)
class Replication:
    """How every Conveyor topic is replicated on one cluster."""

    factor: int
    min_insync: int
    brokers: int

    def configs(self) -> dict[str, str]:
        return {"min.insync.replicas": str(self.min_insync)}


def choose_replication(settings: Settings, brokers: int) -> Replication:
    """The replication for a cluster of ``brokers`` (0 in the settings = choose);
    ConveyorError for more replicas than brokers or more in-sync replicas than
    replicas (every topic, or every ``acks=all`` write, would fail)."""
    if brokers < 1:
        raise BrokerError("the Kafka cluster reports no broker")
    factor = settings.kafka.replication_factor or min(brokers, _AUTO_MAX_REPLICAS)
    if factor > brokers:
        raise ConveyorError(
            f"replication_factor={factor} needs at least {factor} brokers; the cluster at "
            f"{settings.kafka.bootstrap} has {brokers} (set CONVEYOR_REPLICATION_FACTOR=0 "
            "to follow the cluster)")
    min_insync = settings.kafka.min_insync_replicas or (2 if factor >= 3 else 1)
    if min_insync > factor:
        raise ConveyorError(
            f"min_insync_replicas={min_insync} is more than replication_factor={factor}: "
            "no write could ever be acknowledged")
    return Replication(factor=factor, min_insync=min_insync, brokers=brokers)


async def _start(admin: AIOKafkaAdminClient, settings: Settings, wait_s: float) -> None:
    """Connect, waiting (logged, bounded) while the broker refuses connections."""
    await started("the broker to answer, to create the topics", admin.start, within=wait_s,
                  log=log, where=kafka_address(settings.kafka.bootstrap),
                  retry_on=(KafkaConnectionError,))


async def _count_brokers(admin: AIOKafkaAdminClient) -> int:
    cluster: dict[str, Any] = await admin.describe_cluster()
    return len(cluster.get("brokers", ()))


async def _under_replicated(admin: AIOKafkaAdminClient, names: list[str],
                            factor: int) -> list[str]:
    """The topics of ``names`` with a partition of fewer than ``factor`` replicas."""
    if not names:
        return []
    try:
        described: list[dict[str, Any]] = await admin.describe_topics(names)
    except KafkaError as exc:  # a report only: never stop a start for it
        log.warning("could not describe the existing topics: %r", exc)
        return []
    return sorted(t["topic"] for t in described
                  if any(len(p["replicas"]) < factor for p in t.get("partitions", ())))


async def _until_served(admin: AIOKafkaAdminClient, names: list[str], within: float) -> None:
    """Wait (bounded, then only a warning) until the metadata lists every topic of
    ``names`` with a leader for each partition: a client that asks just after the
    create is told the topic does not exist, and may not ask again for minutes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    backoff = Backoff(initial_s=0.05, max_s=1.0)
    waiting = names
    while waiting:
        try:
            described: list[dict[str, Any]] = await admin.describe_topics(waiting)
        except KafkaError as exc:
            described = []
            log.debug("describing the new topics failed for now: %r", exc)
        served = {t["topic"] for t in described
                  if t.get("error_code", 0) == 0 and t.get("partitions")
                  and all(p.get("leader", -1) >= 0 for p in t["partitions"])}
        waiting = [n for n in waiting if n not in served]
        if not waiting:
            return
        pause = backoff.next_delay()
        if loop.time() + pause > deadline:
            log.warning("topics created but not yet served by the broker after %.0f s: %s",
                        within, ", ".join(waiting))
            return
        await asyncio.sleep(pause)


def _created(response: Any) -> list[str]:
    """The topics a create made. The broker answers with an error per topic instead
    of failing the call: an existing topic is fine (another process created it at
    the same moment), anything else is raised."""
    answers = response.to_object()["topic_errors"]
    refused = [t for t in answers if t["error_code"] not in (0, TopicAlreadyExistsError.errno)]
    if refused:
        raise PermanentBrokerError("Kafka refused to create " + "; ".join(
            f"{t['topic']}: {for_code(t['error_code']).__name__} {t.get('error_message') or ''}"
            .rstrip() for t in refused))
    return [t["topic"] for t in answers if t["error_code"] == 0]


async def ensure_topics(settings: Settings, specs: list[TopicSpec],
                        wait_s: float | None = None) -> Replication:
    """Create every topic of ``specs`` that does not exist yet (waits for the broker
    ``wait_s``, default ``settings.process.startup_timeout_s``); returns the replication
    chosen for the cluster."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    within = settings.process.startup_timeout_s if wait_s is None else wait_s
    await _start(admin, settings, within)
    try:
        replication = choose_replication(settings, await _count_brokers(admin))
        existing = set(await admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        if missing:
            new = [NewTopic(s.name, s.partitions, replication.factor,
                            topic_configs={**s.configs(), **replication.configs()})
                   for s in missing]
            created = _created(await started(
                f"Kafka to create {len(new)} topics", lambda: admin.create_topics(new),
                within=within, log=log, where=kafka_address(settings.kafka.bootstrap)))
            if created:
                log.info("created topics %s with replication factor %d, min.insync.replicas "
                         "%d (%d brokers)", ", ".join(created), replication.factor,
                         replication.min_insync, replication.brokers)
            await _until_served(admin, [s.name for s in missing], within)
        weak = await _under_replicated(
            admin, [s.name for s in specs if s.name in existing], replication.factor)
        if weak:
            log.warning("topics replicated fewer than %d times (created on a smaller cluster? "
                        "reassign their partitions): %s", replication.factor, ", ".join(weak))
        return replication
    finally:
        await admin.close()


def drop_topics(bootstrap: str, prefix: str) -> None:
    """Delete every topic of a topic prefix (``<prefix>.*``, and Faust's
    ``<prefix>-*`` changelogs): a finished test's or benchmark's. Runs leave
    thousands of partitions behind otherwise, and a broker holding them all
    starts slowly and runs short of heap. Best effort, bounded: a broker that
    does not answer within 30 s keeps them. Not for a running prefix."""

    async def drop() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
        await admin.start()
        try:
            names = [t for t in await admin.list_topics() if t.startswith(f"{prefix}.")
                     or t.startswith(f"{prefix}-")]
            if names:
                await admin.delete_topics(names, timeout_ms=10_000)
        finally:
            await admin.close()

    try:
        asyncio.run(asyncio.wait_for(drop(), 30))
    except Exception as exc:  # the topics stay; say so
        log.warning("dropping the topics of %s failed: %r", prefix, exc)
