"""An infer worker's membership of its pool's consumer group.

:func:`join_pool` makes the consumer of ``conveyor.infer.<pool>`` in group
``conveyor.infer.<pool>``: the infer group's short session timeout (a dead
worker's partitions move within about 1.5 s), the busy-aware assignor
(workers/infer/assignor.py) and :class:`Rebalance`, the listener that
commits what finished before partitions are revoked and hands off the
generations of partitions that went to another member.

**One assignor only.** aiokafka 0.14 sends one JoinGroup request per
assignor offered (the send sits inside its loop over the assignors:
aio-libs/aiokafka#1168), the first naming only the first assignor. With
the sticky assignor as a fallback every join was two rounds, the second
forced by the member itself changing its protocols, and each round asks
every other member to rejoin within the rebalance timeout (the session
timeout, 1.5 s); a member that misses it is dropped and joins again, two
rounds again: two members joining at once while their event loops stalled
took several times longer to both hold partitions with the pair
(docs/decisions/0022-infer-failover.md). The fallback only served a group
mixing in workers older than the busy-aware assignor.
"""

from __future__ import annotations

from typing import Protocol

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from conveyor.settings import Settings
from topics.catalog import infer_topic
from topics.clients import make_consumer
from workers.infer.assignor import BusyAwareAssignor
from workers.infer.offsets import InFlightOffsets

__all__ = ["Member", "Rebalance", "join_pool"]


class Member(Protocol):
    """What the group's listener and assignor need of an infer worker."""

    partitions: set[TopicPartition]
    # what the worker owned when the last rebalance began (the assignor keeps it)
    owned_before: set[TopicPartition]
    offsets: InFlightOffsets

    async def commit(self) -> None: ...

    async def hand_off_unassigned(self, timeout_s: float = 10.0) -> None: ...

    def beat_soon(self) -> None: ...

    def assignor_state(self) -> tuple[set[TopicPartition], set[TopicPartition]]: ...


class Rebalance(ConsumerRebalanceListener):
    def __init__(self, member: Member) -> None:
        self.member = member

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        self.member.owned_before = set(self.member.partitions)
        await self.member.commit()
        self.member.offsets.forget(list(revoked))
        self.member.partitions -= set(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.member.partitions |= set(assigned)
        await self.member.hand_off_unassigned()
        self.member.beat_soon()


def join_pool(settings: Settings, pool: str, member: Member) -> AIOKafkaConsumer:
    """The (not yet started) consumer of ``pool``'s tasks for ``member``."""
    consumer = make_consumer(
        settings.kafka, group=settings.kafka.group(f"infer.{pool}"),
        session_timeout_ms=settings.infer.session_timeout_ms,
        heartbeat_interval_ms=settings.infer.heartbeat_interval_ms,
        partition_assignment_strategy=(BusyAwareAssignor(member.assignor_state),))
    consumer.subscribe([infer_topic(settings.kafka, pool)], listener=Rebalance(member))
    return consumer
