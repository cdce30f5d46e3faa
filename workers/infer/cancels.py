"""The cancel list of an infer worker, followed from ``conveyor.control``.

Every worker reads every cancel (no consumer group: it is a broadcast),
starting ``request_timeout_s`` back in time, so that a worker that starts (or
takes a partition over) still knows the cancels of tasks queued for it. A
cancel for a request the worker runs stops that generation at once; one for
a task not taken yet is remembered, and the task is never generated.
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
from topics.envelope import now_ms

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
            # the catalog gives conveyor.control one partition
            tp = TopicPartition(self.settings.topic("control"), 0)
            consumer.assign([tp])
            since = now_ms() - int(self.settings.request_timeout_s * 1000)
            found = (await consumer.offsets_for_times({tp: since}))[tp]
            if found is None:
                await consumer.seek_to_end(tp)
            else:
                consumer.seek(tp, found.offset)
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
