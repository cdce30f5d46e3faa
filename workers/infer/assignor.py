"""How the infer group shares its partitions: running answers stay where they are.

A rebalance revokes every partition and assigns them again; a partition
that moves while a generation runs on it stalls the answer until the new
owner has read it back from the log. Each member says in its join request
which partitions it owned and which of them run generations (``busy``). The
assignor keeps every member's partitions where they are, gives the
partitions nobody owns to the members with the fewest, and balances the
counts by moving *idle* partitions first; members with more busy
partitions get the larger shares when the counts cannot be even.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping

from aiokafka import TopicPartition
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)

__all__ = ["BusyAwareAssignor", "share"]

log = logging.getLogger(__name__)

# (owned partitions, busy partitions) of this member, as of the join
State = Callable[[], tuple[set[TopicPartition], set[TopicPartition]]]


def share(partitions: list[int], owned: Mapping[str, list[int]],
          busy: Mapping[str, set[int]]) -> dict[str, list[int]]:
    """One topic's partitions among ``owned``'s members (see the module)."""
    members = sorted(owned)
    if not members:
        return {}
    holder: dict[int, str] = {}
    # a partition two members claim (a stale view) goes to the one running on it
    for member in sorted(members, key=lambda m: (-len(busy.get(m, ())), m)):
        for p in owned[member]:
            if p in partitions and (p not in holder or p in busy.get(member, set())
                                    and p not in busy.get(holder[p], set())):
                holder[p] = member
    quota, extra = divmod(len(partitions), len(members))
    by_need = sorted(members, key=lambda m: (-len(busy.get(m, ())), -len(owned[m]), m))
    target = {m: quota + (1 if i < extra else 0) for i, m in enumerate(by_need)}
    kept: dict[str, list[int]] = {m: [] for m in members}
    for p in sorted(holder):
        kept[holder[p]].append(p)
    free = sorted(p for p in partitions if p not in holder)
    for m in members:
        mine = busy.get(m, set())
        # give up the excess, idle partitions first
        order = sorted(kept[m], key=lambda p: (p in mine, p))
        while len(order) > target[m]:
            free.append(order.pop(0))
        kept[m] = sorted(order)
    free.sort()
    for m in sorted(members, key=lambda m: (len(kept[m]) - target[m], m)):
        while len(kept[m]) < target[m] and free:
            kept[m].append(free.pop(0))
        kept[m].sort()
    return kept


class BusyAwareAssignor:
    """An aiokafka partition assignor (an instance: it reads its worker's state)."""

    name = "conveyor-busy-aware"
    version = 0

    def __init__(self, state: State) -> None:
        self.state = state

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        owned, busy = self.state()
        data = {"owned": [[tp.topic, tp.partition] for tp in sorted(owned)],
                "busy": [[tp.topic, tp.partition] for tp in sorted(busy)]}
        return ConsumerProtocolMemberMetadata(self.version, sorted(topics),
                                              json.dumps(data).encode())

    def assign(self, cluster: ClusterMetadata,
               members: Mapping[str, ConsumerProtocolMemberMetadata]
               ) -> dict[str, ConsumerProtocolMemberAssignment]:
        views = {m: _view(meta.user_data) for m, meta in members.items()}
        topics = sorted({t for meta in members.values() for t in meta.subscription})
        result: dict[str, list[ConsumerProtocolMemberAssignment.Assignment]] = {
            m: [] for m in members}
        for topic in topics:
            partitions = sorted(cluster.partitions_for_topic(topic) or ())
            subscribed = [m for m, meta in members.items() if topic in meta.subscription]
            owned = {m: [p for t, p in views[m][0] if t == topic] for m in subscribed}
            busy = {m: {p for t, p in views[m][1] if t == topic} for m in subscribed}
            for member, parts in share(partitions, owned, busy).items():
                result[member].append(ConsumerProtocolMemberAssignment.Assignment(topic, parts))
        return {m: ConsumerProtocolMemberAssignment(self.version, sorted(a), b"")
                for m, a in result.items()}

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:
        return None


def _view(user_data: bytes) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    try:
        data = json.loads(user_data or b"{}")
        return ([(str(t), int(p)) for t, p in data.get("owned", [])],
                [(str(t), int(p)) for t, p in data.get("busy", [])])
    except (ValueError, TypeError) as exc:  # a member of another version: owns nothing
        log.warning("ignoring unreadable assignor data: %s", exc)
        return [], []
