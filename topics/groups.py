"""The consumer groups of a deployment (those under its topic prefix), each with
its state, members and per-partition lag, in the order the pipeline flows:
what ``conveyor groups`` prints and the console's overview draws. Read in a few
round trips whatever the number of groups and partitions (the requests of one
kind go out together). A group reads whole topics, those it has committed on or
holds partitions of: each of their partitions is listed, committed or not. A
Faust app's own topics (its tables' changelogs, its assignor's), named after
its group, are state it restores, not a backlog: left out. A broker that does
not answer within ``timeout_s`` is a :class:`KafkaConnectionError`, as one
that refuses the connection."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import KafkaConnectionError, for_code
from aiokafka.protocol.admin import (
    DescribeGroupsRequest_v0,
    DescribeGroupsRequest_v1,
    DescribeGroupsRequest_v2,
    DescribeGroupsRequest_v3,
    DescribeGroupsResponse_v3,
)
from aiokafka.protocol.api import Request

from conveyor.settings import Settings
from topics.clients import make_consumer, stop_consumer

__all__ = ["FLOW", "GroupReader", "GroupState", "PartitionLag", "describe_groups", "in_flow_order",
           "lag_of", "layer_of"]

# the layers in the order the pipeline flows (infer: one group per pool, as
# infer:<pool>); a group under the prefix that is none of them comes last
FLOW = ("preprocess", "route", "schedule", "infer", "postprocess", "accounting", "jobs",
        "results", "jobs-dead-letters")
TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    committed: int | None  # None: nothing committed
    end: int
    lag: int  # end - committed (end - start when nothing committed)
    member: str | None  # the member holding it ("client_id@host"), None when unassigned


@dataclass(frozen=True)
class GroupState:
    group: str  # the consumer group id
    layer: str  # preprocess, route, schedule, infer:<pool>, postprocess, accounting, ...
    state: str  # Stable, PreparingRebalance, CompletingRebalance, Empty, Dead
    members: list[str]  # "client_id@host"
    partitions: list[PartitionLag]

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.partitions)


def layer_of(settings: Settings, group: str) -> str | None:
    """What ``group`` is (``conveyor.infer.cpu`` -> ``infer:cpu``); None for a
    group of another prefix."""
    name = group.removeprefix(settings.kafka.group(""))
    if name == group or not name:
        return None
    pool = name.removeprefix("infer.")
    return f"infer:{pool}" if pool != name else name


def in_flow_order(layers: list[str]) -> list[str]:
    """``layers`` as the pipeline flows: :data:`FLOW`'s order, pools by name,
    the layers it does not name last, by name."""
    def rank(layer: str) -> tuple[int, str]:
        kind = layer.partition(":")[0]
        return (FLOW.index(kind) if kind in FLOW else len(FLOW)), layer

    return sorted(layers, key=rank)


def lag_of(committed: int | None, start: int, end: int) -> int:
    """Records not yet consumed: from the commit (or the partition's start when
    nothing is committed) to the end, never below 0."""
    return max(0, end - (start if committed is None else committed))


class _DescribeGroupsV3(DescribeGroupsRequest_v3):
    # aiokafka 0.14 reads a v3 answer as a v2 one, which lacks the field a v3
    # answer ends each group with: the decoding runs over the end and the
    # connection is dropped
    RESPONSE_TYPE = DescribeGroupsResponse_v3


class _DescribeGroups(Request[DescribeGroupsRequest_v0 | DescribeGroupsRequest_v1 |
                              DescribeGroupsRequest_v2 | _DescribeGroupsV3]):
    API_KEY = 15

    def __init__(self, groups: list[str]) -> None:
        self.groups = groups

    def build(self, request_struct_class: Any) -> Any:
        if request_struct_class.API_VERSION < 3:
            return request_struct_class(self.groups)
        return request_struct_class(self.groups, False)


@dataclass(frozen=True)
class _Described:
    state: str
    members: list[str]
    holder: dict[TopicPartition, str]  # partition -> the member it is assigned to


def _described(group: Any) -> _Described:
    error_code, group_id, state, protocol_type, _protocol, members = group[:6]
    if error_code:
        raise for_code(error_code)(f"describing consumer group {group_id}")
    names, holder = [], {}
    for member in members:
        _member_id, client_id, host, _metadata, assignment = member[:5]
        name = f"{client_id}@{host.lstrip('/')}"
        names.append(name)
        if protocol_type == "consumer" and assignment:
            for topic, partitions in ConsumerProtocolMemberAssignment.decode(
                    assignment).assignment:
                holder.update({TopicPartition(topic, p): name for p in partitions})
    return _Described(state, sorted(names), holder)


class GroupReader:
    """An admin client and a group-less consumer, kept between reads: a process
    that reads the groups again and again (the console) keeps one, which
    starts at its first read and starts afresh after a read that failed.
    :func:`describe_groups` reads once."""

    _admin: AIOKafkaAdminClient  # made by each start
    _consumer: AIOKafkaConsumer

    def __init__(self, settings: Settings, timeout_s: float = TIMEOUT_S) -> None:
        self.settings = settings
        self.timeout_s = timeout_s
        self._open = False  # clients made and not closed yet
        self._reading = asyncio.Lock()  # one read at a time over the kept clients

    async def __aenter__(self) -> GroupReader:
        await self.start()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect both clients (:class:`KafkaConnectionError` when the broker
        does not answer in time; nothing is left open then)."""
        async with self._reading:
            await self._start()

    async def _start(self) -> None:
        timeout_ms = int(self.timeout_s * 1000)
        self._admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka.bootstrap,
                                          request_timeout_ms=timeout_ms)
        self._consumer = make_consumer(self.settings.kafka, group=None,
                                       request_timeout_ms=timeout_ms)
        self._open = True
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._admin.start()
                await self._consumer.start()
        except BaseException as exc:
            await self._close()
            if isinstance(exc, TimeoutError):
                raise self._unanswered() from exc
            raise

    async def close(self) -> None:
        """Close both clients; safe on a reader that never started, and twice.
        It waits for a read under way, which would otherwise start clients
        afresh while the old ones are closed."""
        async with self._reading:
            await self._close()

    async def _close(self) -> None:
        if self._open:
            self._open = False
            consumer, admin = self._consumer, self._admin
            await stop_consumer(consumer, self.timeout_s)
            await admin.close()

    def _unanswered(self) -> KafkaConnectionError:
        return KafkaConnectionError(f"Kafka at {self.settings.kafka.bootstrap} did not "
                                    f"answer within {self.timeout_s:.0f} s")

    async def describe(self) -> list[GroupState]:
        """Every consumer group of this deployment, in pipeline order."""
        async with self._reading:
            if not self._open:
                await self._start()
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await self._describe()
            except BaseException as exc:
                await self._close()
                if isinstance(exc, TimeoutError):
                    raise self._unanswered() from exc
                raise

    async def _describe(self) -> list[GroupState]:
        listed = await self._admin.list_consumer_groups()
        layers = {g[0]: layer for g in listed
                  if (layer := layer_of(self.settings, g[0])) is not None}
        if not layers:
            return []
        groups = sorted(layers)
        nodes = await asyncio.gather(*(self._admin.find_coordinator(g) for g in groups))
        by_node: dict[int, list[str]] = defaultdict(list)
        for group, node in zip(groups, nodes, strict=True):
            by_node[node].append(group)
        # the admin client's own DescribeGroups is broken (_DescribeGroupsV3): the
        # request goes through its connections as its other requests do
        answers, offsets = await asyncio.gather(
            asyncio.gather(*(self._admin._client.send(node, _DescribeGroups(ids))
                             for node, ids in by_node.items())),
            asyncio.gather(*(self._admin.list_consumer_group_offsets(g, group_coordinator_id=n)
                             for g, n in zip(groups, nodes, strict=True))))
        described = {g[1]: _described(g) for answer in answers for g in answer.groups}
        committed = {g: {tp: o.offset for tp, o in found.items() if o.offset >= 0}
                     for g, found in zip(groups, offsets, strict=True)}
        # a group reads whole topics: those it committed on or holds partitions of
        read = {g: {tp.topic for tp in set(committed[g]) | set(described[g].holder)
                    if not tp.topic.startswith(f"{g}-")} for g in groups}
        ends, starts = await self._offsets(set().union(*read.values()))
        states = []
        for group in groups:
            d = described[group]
            partitions = [PartitionLag(
                tp.topic, tp.partition, committed[group].get(tp), ends[tp],
                lag_of(committed[group].get(tp), starts[tp], ends[tp]), d.holder.get(tp))
                for tp in sorted(ends) if tp.topic in read[group]]
            states.append(GroupState(group, layers[group], d.state, d.members, partitions))
        order = {layer: i for i, layer in enumerate(in_flow_order(list(layers.values())))}
        return sorted(states, key=lambda s: (order[s.layer], s.group))

    async def _offsets(self, topics: set[str]
                       ) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
        """The end and start offsets of every partition of ``topics``, those
        that are gone (a group's offsets outlive its topics) left out."""
        if not topics:
            return {}, {}
        # the metadata of every topic in one request: the consumer would ask for
        # them one at a time, a retry backoff (100 ms) each
        await self._consumer._client.set_topics(topics)
        partitions = sorted(TopicPartition(topic, p) for topic in topics
                            for p in self._consumer.partitions_for_topic(topic) or ())
        if not partitions:
            return {}, {}
        ends, starts = await asyncio.gather(self._consumer.end_offsets(partitions),
                                            self._consumer.beginning_offsets(partitions))
        return ends, starts


async def describe_groups(settings: Settings) -> list[GroupState]:
    """Every consumer group of this deployment (its topic prefix), in pipeline order."""
    async with GroupReader(settings) as reader:
        return await reader.describe()
