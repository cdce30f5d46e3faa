"""Creates the catalog's topics idempotently at start."""

from __future__ import annotations

import asyncio
import logging

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError

from conveyor.errors import BrokerError
from conveyor.settings import Settings
from topics.catalog import TopicSpec

__all__ = ["ensure_topics"]

log = logging.getLogger(__name__)


async def ensure_topics(settings: Settings, specs: list[TopicSpec], wait_s: float = 60.0) -> None:
    """Create every topic of ``specs`` that does not exist yet (waits for the broker)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        try:
            await admin.start()
            break
        except KafkaConnectionError as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise BrokerError(f"Kafka at {settings.kafka_bootstrap} did not answer") from exc
            await asyncio.sleep(0.5)
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        if missing:
            new = [
                NewTopic(s.name, s.partitions, 1, topic_configs=s.configs()) for s in missing
            ]
            try:
                await admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass  # another process created them at the same moment
            log.info("created topics %s", ", ".join(s.name for s in missing))
    finally:
        await admin.close()
