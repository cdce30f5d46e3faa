"""FinishFollower on the real broker: the final chunks of the requests schedule
waits for, from every partition of conveyor.tokens."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka.partitioner import DefaultPartitioner

from conveyor.settings import load_settings
from schemas.codec import default_codec
from schemas.records import ErrorInfo, TokenChunk
from tests.support.schedule_tasks import full_task
from topics.admin import ensure_topics
from topics.catalog import catalog
from topics.clients import make_producer
from workers.infer.token_records import TokenRecords
from workers.outputs import Sender
from workers.schedule.outstanding import FinishFollower


def chunk(rid: str, seq: int, finish: str | None, error: ErrorInfo | None = None
          ) -> TokenChunk:
    return TokenChunk(envelope=full_task(rid)["envelope"], seq=seq, text="x", tokens=1,
                      finish_reason=finish, worker_id="w7", header=None, error=error,
                      run_id="run", run_start=0)


async def test_final_and_error_chunks_of_wanted_requests_are_heard(services: None) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    await ensure_topics(settings, [s for s in catalog(settings.kafka)
                                   if s.name == settings.kafka.topic("tokens")])
    heard: list[tuple[str, str, int]] = []
    errors: dict[str, ErrorInfo | None] = {}

    def on_finish(rid: str, wid: str, ts: int, error: ErrorInfo | None) -> None:
        heard.append((rid, wid, ts))
        errors[rid] = error

    wanted = {f"want{i}" for i in range(8)} | {"failed"}
    follower = FinishFollower(settings, wanted.__contains__, on_finish)
    ready = asyncio.Event()
    running = asyncio.create_task(follower.run(ready))
    producer = make_producer(settings.kafka)
    await producer.start()
    codec = default_codec()
    try:
        await asyncio.wait_for(ready.wait(), 20)
        error = ErrorInfo(status=500, type="server_error", code=None, param=None, message="x")
        chunks = [chunk(f"want{i}", 0, None) for i in range(8)]  # spread over the partitions
        chunks += [chunk(f"want{i}", 1, "stop") for i in range(8)]
        chunks += [chunk("other", 0, None), chunk("other", 1, "length"),
                   chunk("failed", 0, None, error)]
        # as a worker writes them: one record a partition, holding several requests' chunks
        records = TokenRecords(settings, Sender(settings, producer, codec))
        written = [records.add(c, records.partition(c["envelope"]["request_id"]), False)
                   for c in chunks]
        await records.flush(tick=True)
        await asyncio.gather(*written)
        assert records.records <= settings.kafka.pipeline_partitions < len(chunks)
        for _ in range(100):
            if len(heard) >= 9:
                break
            await asyncio.sleep(0.1)
        assert sorted(rid for rid, _, _ in heard) == sorted(wanted)
        assert {wid for _, wid, _ in heard} == {"w7"} and all(ts > 0 for _, _, ts in heard)
        # the breakers hear how each ended
        assert errors["failed"] == error and errors["want0"] is None
        # one consumer reads every partition, and the ends heard came from several
        assert follower.follower is not None
        assert [tp.partition for tp in follower.follower.tps] == \
            list(range(settings.kafka.pipeline_partitions))
        everyone = list(range(settings.kafka.pipeline_partitions))
        assert len({DefaultPartitioner()(rid.encode(), everyone, everyone)
                    for rid, _, _ in heard}) > 1
    finally:
        running.cancel()
        await producer.stop()
        with pytest.raises(asyncio.CancelledError):
            await running
