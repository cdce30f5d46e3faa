"""Kafka client factories with Conveyor's production settings.

Producers: acks=all, idempotent (switchable for brokers without it), a small
linger. Consumers: manual commits, fetch returning as soon as one record is
there (tuned for loopback latency), read-committed off.
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from conveyor.settings import Settings

__all__ = ["make_producer", "make_consumer"]


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "acks": "all",
        "enable_idempotence": settings.producer_idempotent,
        "linger_ms": settings.producer_linger_ms,
        "compression_type": None if settings.producer_compression == "none"
        else settings.producer_compression,
        "request_timeout_ms": 30000,
        "max_batch_size": 1 << 20,
    }
    options.update(overrides)
    return AIOKafkaProducer(**options)


def make_consumer(
    settings: Settings, *topics: str, group: str | None = None, **overrides: Any
) -> AIOKafkaConsumer:
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "group_id": group,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "fetch_min_bytes": 1,
        # the broker answers a fetch as soon as one record is there; the wait
        # only bounds how often an idle consumer asks
        "fetch_max_wait_ms": 500,
        "session_timeout_ms": settings.consumer_session_timeout_ms,
        "heartbeat_interval_ms": settings.consumer_heartbeat_interval_ms,
        "max_poll_interval_ms": 300000,
        "isolation_level": "read_uncommitted",
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)
