"""The accounting app's consumer fetches in batches: nobody waits on a usage event.

Faust's aiokafka driver makes its consumer with ``fetch_min_bytes`` left at 1, so
the broker answers a fetch as soon as one record is there: at a few hundred
requests a second that is a fetch, a response and a hand-over from Faust's
consumer thread to its event loop for nearly every usage event, and 400 µs of
the accounting app's CPU a request in ``bench.profile`` (40 % of it waiting in
``select`` between them). Counting is off the request's path (the client has its
answer), so the broker may hold a fetch until :data:`FETCH_MIN_BYTES` are
there or :data:`FETCH_MAX_WAIT_MS` have passed: usage counts arrive up to that
much later, in fewer and fuller fetches.

:func:`batched_fetch_transport` is the transport the app then uses in place of
Faust's own; it changes nothing else about the consumer (the same group,
commits, rebalances and table recovery, whose reads fill any batch at once).
"""

from __future__ import annotations

from typing import Any

import aiokafka
import faust
from faust.transport.drivers import aiokafka as faust_aiokafka

__all__ = ["FETCH_MAX_WAIT_MS", "FETCH_MIN_BYTES", "batched_fetch_transport"]

FETCH_MIN_BYTES = 64 * 1024
FETCH_MAX_WAIT_MS = 100


class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        # read by AIOKafkaConsumer.start() when it makes its fetcher
        consumer._fetch_min_bytes = FETCH_MIN_BYTES
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


class _Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class _Transport(faust_aiokafka.Transport):
    Consumer = _Consumer


def batched_fetch_transport(app: faust.App) -> faust_aiokafka.Transport:
    """A transport for ``app`` (set before it starts) whose consumer fetches in batches."""
    return _Transport(app.conf.broker_consumer, app)
