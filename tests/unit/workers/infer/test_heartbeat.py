"""A worker's heartbeat carries its engine's KV cache as the Avro record has it,
and none where the engine keeps no cache the worker can see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from conveyor.settings import load_settings
from schemas.codec import default_codec
from schemas.records import HostCache, KvCache
from workers.infer.engines.base import Engine
from workers.infer.engines.llamacpp_cache import kv_bytes_per_token
from workers.infer.engines.scripted import ScriptedEngine
from workers.infer.heartbeat import Heartbeat, Snapshot, Speed, reported_blocks
from workers.outputs import Output, Sender
from workers.prefix import HeldBlocks


@dataclass
class Delivered:
    """Stands in for the Sender at the seam: keeps what would be delivered."""

    outputs: list[Output] = field(default_factory=list)

    async def deliver(self, output: Output) -> None:
        self.outputs.append(output)


class Reports(ScriptedEngine):
    """An engine whose KV cache and host cache are ``kv`` and ``host_cache``."""

    def __init__(self, kv: KvCache | None, host_cache: HostCache | None) -> None:
        super().__init__()
        self.kv, self.host_cache = kv, host_cache

    def kv_state(self) -> KvCache | None:
        return self.kv

    def host_cache_stats(self) -> HostCache | None:
        return self.host_cache


async def beat(kv: KvCache | None, prefix_blocks: list[int] | None = None,
               host_cache: HostCache | None = None) -> dict[str, Any]:
    sent = Delivered()
    settings = load_settings(topic_prefix="hb",
                             prefix_report_blocks=1024 if prefix_blocks is not None else 0)
    held = HeldBlocks()
    held.took(prefix_blocks or [])
    heartbeat = Heartbeat(settings, cast(Sender, sent), "w0", "cpu", Reports(kv, host_cache),
                          ["smollm2"], lambda: Snapshot([0, 1], 1), held, Speed())
    await heartbeat.beat()
    [output] = sent.outputs
    codec = default_codec()
    decoded: dict[str, Any] = codec.decode(codec.encode("WorkerHeartbeat", output.record),
                                           "WorkerHeartbeat")
    return decoded


async def test_the_kv_cache_goes_out_with_the_heartbeat() -> None:
    kv = KvCache(usage=0.25, total_blocks=2048, free_blocks=1536, cached_blocks=300,
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


class Holds(ScriptedEngine):
    """An engine whose caches hold ``tokens`` (Engine.cache_tokens)."""

    def __init__(self, tokens: int | None) -> None:
        super().__init__()
        self.tokens = tokens

    def cache_tokens(self) -> int | None:
        return self.tokens


async def test_the_host_cache_goes_out_with_the_heartbeat() -> None:
    stats = HostCache(saved=9, restored=4, evicted=1, held_bytes=50 << 20, entries=5)
    assert (await beat(None, host_cache=stats))["host_cache"] == {
        "held_bytes": 50 << 20, "entries": 5, "saved": 9, "restored": 4, "evicted": 1}
    assert (await beat(None))["host_cache"] is None


def test_a_worker_reports_no_more_blocks_than_its_caches_hold() -> None:
    """Of 100 blocks of 64 tokens run: all, where the engine cannot say; as
    many as its KV cache holds; as many as its contexts and host memory hold."""
    settings = load_settings(prefix_block_tokens=64, prefix_report_blocks=1024)

    def report(engine: Engine, kv: KvCache | None) -> list[int] | None:
        held = HeldBlocks(1024)
        held.took(list(range(100)))
        return reported_blocks(held, engine, kv, settings)

    assert report(ScriptedEngine(), None) == list(range(100))
    assert report(Holds(None), None) == list(range(100))
    assert report(Holds(30 * 64 + 10), None) == list(range(70, 100))  # the most recent
    kv = KvCache(usage=0.0, total_blocks=40, free_blocks=40, cached_blocks=0, block_tokens=16,
                 prefix_queries=0, prefix_hits=0)
    assert report(Holds(None), kv) == list(range(90, 100))  # 640 tokens of KV: 10 blocks
    assert report(Holds(30 * 64), kv) == list(range(70, 100))  # and host memory behind it
    assert reported_blocks(HeldBlocks(), ScriptedEngine(), None,
                           load_settings(prefix_report_blocks=0)) is None


def test_a_tokens_kv_comes_from_the_models_metadata() -> None:
    """SmolLM2-135M: 30 layers, 3 KV heads of 576 / 9 = 64, f16 keys and values."""
    smollm2 = {"general.architecture": "llama", "llama.block_count": "30",
               "llama.attention.head_count": "9", "llama.attention.head_count_kv": "3",
               "llama.embedding_length": "576"}
    assert kv_bytes_per_token(smollm2) == 23_040
    assert kv_bytes_per_token({"general.architecture": "llama"}) is None
