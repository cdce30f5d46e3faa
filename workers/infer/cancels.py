"""The cancel list of an infer worker, followed from ``conveyor.control``.

Every worker reads every cancel (no consumer group: it is a broadcast), from
the moment it starts; a cancel for a request the worker runs stops that
generation at once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from aiokafka import TopicPartition

from conveyor.errors import SchemaError
from conveyor.settings import Settings
from schemas.codec import Codec
from topics.clients import make_consumer

__all__ = ["CancelFollower"]

log = logging.getLogger(__name__)

_REMEMBER = 100_000


class CancelFollower:
    def __init__(self, settings: Settings, codec: Codec,
                 on_cancel: Callable[[str], None]) -> None:
        self.settings = settings
        self.codec = codec
        self.on_cancel = on_cancel
        self.cancelled: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.cancelled

    async def run(self) -> None:
        consumer = make_consumer(self.settings, group=None, auto_offset_reset="latest")
        await consumer.start()
        try:
            topic = self.settings.topic("control")
            parts = {0}  # the catalog gives conveyor.control one partition
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            while True:
                batch = await consumer.getmany(timeout_ms=1000)
                for records in batch.values():
                    for record in records:
                        try:
                            control = self.codec.decode(record.value, "Control")
                        except SchemaError as exc:
                            log.warning("ignoring a bad control event: %s", exc)
                            continue
                        rid = control["request_id"]
                        self.cancelled[rid] = None
                        if len(self.cancelled) > _REMEMBER:
                            self.cancelled.popitem(last=False)
                        self.on_cancel(rid)
        finally:
            await consumer.stop()
