"""Task claims on the real Redis, progress read back from the real broker."""

from __future__ import annotations

import uuid

import redis.asyncio as aioredis

from conveyor.settings import load_settings
from schemas.codec import default_codec
from schemas.records import TokenChunk
from tests.support.schedule_tasks import full_task
from topics.admin import ensure_topics
from topics.catalog import TOKENS, catalog
from topics.clients import make_producer
from topics.envelope import now_ms
from topics.lookup import SharedLookup, key_partition
from topics.reader import request_ids_header
from workers.infer.progress import ProgressTracker


def chunk(rid: str, seq: int, text: str) -> TokenChunk:
    return TokenChunk(envelope=full_task(rid)["envelope"], seq=seq, text=text, tokens=1,
                      finish_reason=None, worker_id="w0", header=None, error=None,
                      run_id="run-a", run_start=0)


async def test_a_run_that_kafka_interrupted_claims_its_task_again(
        services: None, redis: aioredis.Redis) -> None:
    """The worker still renews the lease of a run that failed for a passing reason
    (a chunk's batch expired while the broker was away): its retry is not a
    duplicate waiting for that lease, it continues from the log at once."""
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    await ensure_topics(settings, [s for s in catalog(settings.kafka)
                                   if s.name == TOKENS.at(settings.kafka)])
    producer = make_producer(settings.kafka)
    await producer.start()
    lookup = SharedLookup(settings)
    tracker = ProgressTracker(settings, redis, lookup)
    rid, entered = f"r{uuid.uuid4().hex[:8]}", now_ms()
    try:
        claim, done = await tracker.claim(rid, "w0", entered, entered)
        assert (claim, done.next_seq) == ("start", 0)
        for seq, text in enumerate([" 6,", " 7,"]):  # each beside another request's chunk
            chunks = [chunk(f"{rid}-other", seq, " 0,"), chunk(rid, seq, text)]
            await producer.send_and_wait(
                TOKENS.at(settings.kafka), TOKENS.encode(default_codec(), TOKENS.pack(chunks)),
                partition=key_partition(rid.encode(), TOKENS.partitions(settings.kafka)),
                headers=[request_ids_header(c["envelope"]["request_id"] for c in chunks)])
        await tracker.keep([rid], "w0")  # the worker renews it while the run retries
        claim, done = await tracker.claim(rid, "w0", entered, entered)
        assert (claim, done.next_seq, done.text) == ("start", 2, " 6, 7,")
        claim, _ = await tracker.claim(rid, "w1", entered, entered)
        assert claim == "busy"  # another worker's claim is a duplicate: it waits
    finally:
        await lookup.close()
        await producer.stop()


async def test_a_claim_loads_its_script_again_when_redis_lost_it(
        services: None, redis: aioredis.Redis) -> None:
    """Claims run by EVALSHA; a restarted Redis has no scripts (SCRIPT FLUSH is
    what it starts with), and the next claim loads the script again."""
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    await ensure_topics(settings, [s for s in catalog(settings.kafka)
                                   if s.name == TOKENS.at(settings.kafka)])
    lookup = SharedLookup(settings)
    tracker = ProgressTracker(settings, redis, lookup)
    try:
        entered = now_ms()
        assert (await tracker.claim("ra", "w0", entered, entered))[0] == "start"
        await redis.script_flush()
        assert (await tracker.claim("rb", "w0", entered, entered))[0] == "start"
        assert (await tracker.claim("rb", "w1", entered, entered))[0] == "busy"
        assert tracker.redis_ok
    finally:
        await lookup.close()
