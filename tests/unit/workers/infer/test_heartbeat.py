"""A worker's heartbeat carries its engine's KV cache as the Avro record has it,
and none where the engine keeps no cache the worker can see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from conveyor.settings import Settings
from schemas.codec import default_codec
from workers.infer.engines.base import KvState
from workers.infer.heartbeat import Heartbeat, Snapshot
from workers.outputs import Output, Sender


@dataclass
class Delivered:
    """Stands in for the Sender at the seam: keeps what would be delivered."""

    outputs: list[Output] = field(default_factory=list)

    async def deliver(self, output: Output) -> None:
        self.outputs.append(output)


async def beat(kv: KvState | None, prefix_blocks: list[int] | None = None) -> dict[str, Any]:
    sent = Delivered()
    heartbeat = Heartbeat(Settings(topic_prefix="hb"), cast(Sender, sent), "w0", "cpu",
                          "llamacpp-batch", ["smollm2"], 4,
                          lambda: Snapshot([0, 1], 1, 0, kv=kv, prefix_blocks=prefix_blocks))
    await heartbeat.beat()
    [output] = sent.outputs
    codec = default_codec()
    decoded: dict[str, Any] = codec.decode(codec.encode("WorkerHeartbeat", output.record),
                                           "WorkerHeartbeat")
    return decoded


async def test_the_kv_cache_goes_out_with_the_heartbeat() -> None:
    kv = KvState(usage=0.25, total_blocks=2048, free_blocks=1536, cached_blocks=300,
                 block_tokens=1, prefix_queries=900, prefix_hits=400)
    record = await beat(kv)
    assert record["kv"] == {"usage": 0.25, "total_blocks": 2048, "free_blocks": 1536,
                            "cached_blocks": 300, "block_tokens": 1, "prefix_queries": 900,
                            "prefix_hits": 400}
    assert record["running"] == 1 and record["partitions"] == [0, 1]


async def test_an_engine_without_a_visible_cache_sends_none() -> None:
    assert (await beat(None))["kv"] is None


async def test_the_blocks_its_cache_holds_go_out_with_the_heartbeat() -> None:
    """Signed 64-bit hashes survive the Avro round trip; None: the worker does
    not say (schedule keeps its own guesses)."""
    blocks = [-(2 ** 63), 5, 2 ** 63 - 1]
    assert (await beat(None, blocks))["prefix_blocks"] == blocks
    assert (await beat(None))["prefix_blocks"] is None
