"""Topic creation against the real broker: replication chosen from the cluster,
and each topic's cleanup and retention as the broker reports and applies them
(a compacted topic keeps the latest value of each key; a wrong policy would lose
heartbeats or job results, or keep every one of them forever)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from conveyor.errors import ConveyorError
from conveyor.settings import Settings, load_settings
from topics.admin import Replication, choose_replication, drop_topics, ensure_topics
from topics.catalog import catalog

BOOTSTRAP = "127.0.0.1:9092"


def fresh(**overrides: Any) -> Settings:
    return load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}", kafka_bootstrap=BOOTSTRAP,
                    **overrides)


# -- the choice ----------------------------------------------------------------------


@pytest.mark.parametrize(("brokers", "factor", "min_insync"),
                         [(1, 1, 1), (2, 2, 1), (3, 3, 2), (5, 3, 2)])
def test_replication_follows_the_cluster(brokers: int, factor: int, min_insync: int) -> None:
    assert choose_replication(load_settings(), brokers) == Replication(factor, min_insync, brokers)


def test_replication_from_the_settings() -> None:
    assert choose_replication(load_settings(replication_factor=2), 5) == Replication(2, 1, 5)
    assert choose_replication(load_settings(min_insync_replicas=1), 3) == Replication(3, 1, 3)
    assert choose_replication(load_settings(replication_factor=3, min_insync_replicas=3),
                              3) == Replication(3, 3, 3)


def test_replication_the_cluster_cannot_give_is_refused_clearly() -> None:
    with pytest.raises(ConveyorError, match="needs at least 3 brokers.*has 1"):
        choose_replication(load_settings(replication_factor=3), 1)
    with pytest.raises(ConveyorError, match="min_insync_replicas=3 is more than"):
        choose_replication(load_settings(replication_factor=2, min_insync_replicas=3), 2)


# -- on the broker -------------------------------------------------------------------


async def _describe(settings: Settings, names: list[str]
                    ) -> tuple[dict[str, dict[str, str]], dict[str, list[Any]]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
        topics = await admin.describe_topics(names)
    finally:
        await admin.close()
    resources = [r for resp in responses for r in resp.to_object()["resources"]]
    assert not [r for r in resources if r["error_code"]], resources
    configs = {r["resource_name"]: {e["config_names"]: e["config_value"]
                                    for e in r["config_entries"]} for r in resources}
    return configs, {t["topic"]: t["partitions"] for t in topics}


async def test_created_topics_carry_their_policies_on_the_broker(
        services: None, caplog: pytest.LogCaptureFixture) -> None:
    s = fresh()
    specs = catalog(s.kafka, ("cpu",))
    with caplog.at_level(logging.INFO, logger="topics.admin"):
        chosen = await ensure_topics(s, specs)
        again = await ensure_topics(s, specs)  # idempotent: a second process starting
    assert chosen == again == Replication(1, 1, 1)  # the shared single broker
    assert "replication factor 1, min.insync.replicas 1 (1 brokers)" in caplog.text
    configs, partitions = await _describe(s, [spec.name for spec in specs])
    assert set(configs) == {spec.name for spec in specs}
    for name, config in configs.items():
        assert config["min.insync.replicas"] == "1", name
        assert all(len(p["replicas"]) == 1 for p in partitions[name]), name
    # state rebuilt by key (worker table, finished jobs, breakers, the registry
    # and the content policies applied) is compacted; the event streams are
    # deleted by age
    compacted = {n for n, c in configs.items() if c["cleanup.policy"] == "compact"}
    assert compacted == {s.kafka.topic(name) for name in (
        "workers", "job-status", "keys", "breakers", "models", "policies")}
    # a worker's last heartbeat is never deleted by age, only replaced
    assert int(configs[s.kafka.topic("workers")]["retention.ms"]) == -1
    # a retry continues from conveyor.tokens: it must outlive a task's claim
    assert int(configs[s.kafka.topic("tokens")]["retention.ms"]) >= s.infer.progress_ttl_s * 1000
    # a finished job's result can be fetched for days, a dead letter examined for weeks
    assert int(configs[s.kafka.topic("results")]["retention.ms"]) >= 24 * 3600 * 1000
    assert int(configs[s.kafka.topic("dlq")]["retention.ms"]) >= 7 * 24 * 3600 * 1000
    assert len(partitions[s.kafka.topic("infer.cpu")]) == s.kafka.infer_partitions


async def test_more_replicas_than_brokers_is_refused_before_anything_is_created(
        services: None) -> None:
    s = fresh(replication_factor=3)
    with pytest.raises(ConveyorError, match="needs at least 3 brokers"):
        await ensure_topics(s, catalog(s.kafka))
    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    await admin.start()
    try:
        left = [t for t in await admin.list_topics() if t.startswith(s.kafka.topic_prefix + ".")]
        assert not left
    finally:
        await admin.close()


async def _read_all(topic: str) -> list[tuple[bytes, bytes]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=BOOTSTRAP, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        out: list[tuple[bytes, bytes]] = []
        while await consumer.position(tp) < end:
            for records in (await consumer.getmany(tp, timeout_ms=1000)).values():
                out.extend((r.key or b"", r.value or b"") for r in records)
        return out
    finally:
        await consumer.stop()


async def test_the_worker_table_topic_keeps_the_latest_heartbeat_of_each_worker(
        services: None) -> None:
    """The broker compacts conveyor.workers: older heartbeats of a worker go, its
    latest stays (so the table a reader rebuilds is small and current). Segments
    roll every 200 ms here instead of ten minutes, so compaction is seen in a test."""
    s = fresh()
    [workers] = [spec for spec in catalog(s.kafka) if spec.name == s.kafka.topic("workers")]
    await ensure_topics(s, [dataclasses.replace(workers, extra={"segment.ms": "200"})])
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all")
    await producer.start()
    try:
        for beat in range(3):
            for worker in range(5):
                await producer.send_and_wait(workers.name, f"beat {beat}".encode(),
                                             key=f"w{worker}".encode())
            await asyncio.sleep(0.5)  # the next record rolls the segment
        await producer.send_and_wait(workers.name, b"beat 0", key=b"w-new")
    finally:
        await producer.stop()
    deadline = time.monotonic() + 90  # the cleaner looks every 15 s by default
    records = await _read_all(workers.name)
    while len(records) > 6 and time.monotonic() < deadline:
        await asyncio.sleep(2)
        records = await _read_all(workers.name)
    assert records == [(f"w{w}".encode(), b"beat 2") for w in range(5)] + [(b"w-new", b"beat 0")]


async def test_a_prefix_is_dropped_whole_and_nothing_else(services: None) -> None:
    """A finished run's topics go, Faust's changelogs with them; a prefix that
    merely starts the same keeps its own."""
    s = fresh()
    other = f"{s.kafka.topic_prefix}x"
    names = [s.kafka.topic("requests"), f"{s.kafka.topic_prefix}-accounting-usage-totals-changelog",
             f"{other}.requests"]
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, 1, 1) for n in names])
        # a finished run's topics are in the broker's metadata: a list made a
        # moment after the create may not show them yet on a loaded machine
        deadline = time.monotonic() + 30
        while {t for t in await admin.list_topics() if t in names} != set(names):
            assert time.monotonic() < deadline, "the new topics never showed"
            await asyncio.sleep(0.2)
        await asyncio.to_thread(drop_topics, s.kafka.bootstrap, s.kafka.topic_prefix)
        deadline = time.monotonic() + 30
        while (left := {t for t in await admin.list_topics() if t in names}) != {names[2]}:
            assert time.monotonic() < deadline, left
            await asyncio.sleep(0.2)
        await asyncio.to_thread(drop_topics, s.kafka.bootstrap, other)
    finally:
        await admin.close()
