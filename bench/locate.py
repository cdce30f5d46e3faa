"""What finding a request in the log costs a resume: a reader made per call
against the gateway's shared keyed lookup, and one reader against a pool.

Writes 20 request events (and, for the last figure, 30,000 records of 512
bytes to a one-partition topic) under a fresh topic prefix, then times
:func:`gateway.resume.locate`:

- ``per call``: a lookup started, used and closed for each locate (what each
  resume paid before the gateway kept one);
- ``shared``: the gateway's long-lived lookup, its readers warmed first;
- ``40 at once``: 40 concurrent locates, one reader against four;
- ``behind a slow read``: 20 locates while one call reads the whole busy
  partition, one reader against four.

Kafka must run. The topics are dropped at the end.

    python -m bench.locate
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable

from aiokafka.admin import AIOKafkaAdminClient

from conveyor.settings import Settings
from gateway.resume import locate
from schemas.codec import Codec, default_codec
from schemas.openai.generations import chat_generation
from schemas.openai.requests import ChatCompletionRequest
from schemas.records import Request
from topics.admin import ensure_topics
from topics.catalog import REQUESTS, TopicSpec, catalog
from topics.clients import make_producer
from topics.envelope import new_envelope, new_request_id
from topics.shared_lookup import SharedLookup

_BUSY_RECORDS = 30_000


def _summary(ms: list[float]) -> str:
    ms = sorted(ms)
    return (f"p50 {statistics.median(ms):6.1f} ms  p90 {ms[int(0.9 * len(ms))]:6.1f} ms  "
            f"max {ms[-1]:6.1f} ms")


async def _timed(call: Awaitable[object]) -> float:
    started = time.perf_counter()
    assert await call is not None
    return (time.perf_counter() - started) * 1000


async def _write(settings: Settings, busy: str) -> list[str]:
    codec = default_codec()
    producer = make_producer(settings)
    await producer.start()
    generation = chat_generation(ChatCompletionRequest.model_validate(
        {"model": "bench", "messages": [{"role": "user", "content": "Hi"}]}))
    rids = []
    try:
        for _ in range(20):
            rid = new_request_id()
            envelope = new_envelope(rid, reply_gateway="g", reply_partition=0)
            await producer.send_and_wait(
                REQUESTS.at(settings),
                codec.encode("Request", Request(envelope=envelope, generation=generation)),
                key=rid.encode())
            rids.append(rid)
        pending = [await producer.send(busy, b"x" * 512, key=b"busy")
                   for _ in range(_BUSY_RECORDS)]
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return rids


async def _per_call(settings: Settings, codec: Codec, rid: str) -> object:
    lookup = SharedLookup(settings, readers=1)
    try:
        return await locate(lookup, codec, rid)
    finally:
        await lookup.close()


async def _shared(settings: Settings, codec: Codec, rids: list[str], busy: str,
                  size: int) -> None:
    lookup = SharedLookup(settings, readers=size)
    try:
        await asyncio.gather(*(locate(lookup, codec, r) for r in rids[:size]))  # warm
        times = [await _timed(locate(lookup, codec, rids[i % 20])) for i in range(40)]
        print(f"shared({size}) x40: {_summary(times)}")
        started = time.perf_counter()
        found = await asyncio.gather(*(locate(lookup, codec, r) for r in rids * 2))
        print(f"shared({size}) 40 at once: {(time.perf_counter() - started) * 1000:.0f} ms "
              f"wall, all found: {all(found)}")
        slow = asyncio.create_task(lookup.find(busy, None, 0, timeout_s=60))
        await asyncio.sleep(0.05)
        during = await asyncio.gather(*(_timed(locate(lookup, codec, r)) for r in rids))
        read = len(await slow)
        print(f"shared({size}) behind a slow read of {read} records: {_summary(during)}")
    finally:
        await lookup.close()


async def main() -> None:
    settings = Settings(topic_prefix=f"bench{uuid.uuid4().hex[:8]}")
    busy = settings.topic("busy")
    requests = [s for s in catalog(settings) if s.name == REQUESTS.at(settings)]
    await ensure_topics(settings, [*requests, TopicSpec(busy, 1, "none")])
    await asyncio.sleep(2)  # the new topics' leaders
    codec = default_codec()
    try:
        rids = await _write(settings, busy)
        times = [await _timed(_per_call(settings, codec, rids[i % 20])) for i in range(40)]
        print(f"per call   x40: {_summary(times)}")
        for size in (1, 4):
            await _shared(settings, codec, rids, busy, size)
    finally:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        await admin.start()
        try:
            await admin.delete_topics([REQUESTS.at(settings), busy])
        finally:
            await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
