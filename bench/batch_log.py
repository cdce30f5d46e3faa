"""What ``bench.batch`` reads beside its own measurements: the log (when
schedule sent each task, when its final chunk was written, each interactive
request's layer stamps, the heartbeats) and the CPU each process used."""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from bench.harness import (
    BenchError,
)
from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from topics.catalog import REPLIES, TOKENS, infer_topic
from topics.catalog import WORKERS as HEARTBEATS

__all__ = ["InFlight", "CpuMeter", "cpu_since", "WORKERS", "CAPACITY", "POOL"]

# the bench's shape: infer workers, the generations each serves at once, their pool
WORKERS, CAPACITY, POOL = 2, 8, "bench"


@dataclass
class InFlight:
    """What the log shows: when schedule sent each task and when its final chunk
    was written (the records' own times: this host's clock), each interactive
    request's layer stamps from its first reply, the latest heartbeats.

    Only heartbeats are read live; the other topics are paused while the bench
    measures and read afterwards (``collect``), so that decoding them costs the
    measuring client nothing."""

    settings: Settings
    sent: dict[str, float] = field(default_factory=dict)  # request id -> task written
    ended: dict[str, float] = field(default_factory=dict)  # request id -> final chunk
    stamps: dict[str, dict[str, int]] = field(default_factory=dict)  # request id -> layer: us
    beats: dict[str, tuple[str, int]] = field(default_factory=dict)  # worker -> state, parts
    partition: dict[str, int] = field(default_factory=dict)  # request id -> task partition
    owner: dict[int, str] = field(default_factory=dict)  # task partition -> worker
    chunks: collections.Counter[str] = field(default_factory=collections.Counter)
    all_ready: asyncio.Event = field(default_factory=asyncio.Event)  # WORKERS ready
    _steps: list[tuple[float, int, int]] = field(default_factory=list)  # (t, batch, inter.)
    _paused: list[TopicPartition] = field(default_factory=list)
    _consumer: AIOKafkaConsumer | None = None

    async def run(self, ready: asyncio.Event) -> None:
        s = self.settings
        topics = (infer_topic(s, POOL), TOKENS.at(s), REPLIES.at(s), HEARTBEATS.at(s))
        consumer = self._consumer = AIOKafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap, enable_auto_commit=False, fetch_max_wait_ms=20)
        await consumer.start()
        try:
            await consumer._client.force_metadata_update()
            consumer.assign([TopicPartition(t, p) for t in topics
                             for p in sorted(consumer.partitions_for_topic(t) or ())])
            await consumer.seek_to_end()
            for tp in consumer.assignment():
                await consumer.position(tp)
            self._paused = [tp for tp in consumer.assignment() if tp.topic != topics[-1]]
            consumer.pause(*self._paused)
            ready.set()
            codec = default_codec()
            while True:
                for tp, records in (await consumer.getmany(timeout_ms=100)).items():
                    for r in records:
                        self._read(topics.index(tp.topic), r, codec)
        finally:
            await consumer.stop()

    def _read(self, topic: int, r: ConsumerRecord[bytes, bytes], codec: Codec) -> None:
        key = (r.key or b"").decode(errors="replace")
        if topic == 0:  # a task schedule sent
            self.sent.setdefault(key, r.timestamp / 1000)
            self.partition.setdefault(key, r.partition)
        elif topic == 1 and key not in self.ended:  # a chunk
            self.chunks[key] += 1
            chunk = codec.decode(r.value, "TokenChunk")
            if chunk["finish_reason"] is not None or chunk["error"] is not None:
                self.ended[key] = r.timestamp / 1000
        elif topic == 2 and key not in self.stamps and not key.startswith("batch_"):
            self.stamps[key] = codec.decode(r.value, "Reply")["envelope"]["stamps"]
        elif topic == 3 and r.value:  # a heartbeat
            beat = codec.decode(r.value, "WorkerHeartbeat")
            self.beats[beat["worker_id"]] = (beat["state"], len(beat["partitions"]))
            self.owner.update(dict.fromkeys(beat["partitions"], beat["worker_id"]))
            if self.ready_workers() >= WORKERS:
                self.all_ready.set()

    async def collect(self, timeout_s: float = 60.0) -> None:
        """Read the paused topics up to their ends now (``run`` goes on meanwhile)."""
        assert self._consumer is not None
        ends = await self._consumer.end_offsets(self._paused)
        self._consumer.resume(*self._paused)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            positions = [await self._consumer.position(tp) for tp in self._paused]
            if all(pos >= ends[tp] for pos, tp in zip(positions, self._paused, strict=True)):
                return
            await asyncio.sleep(0.1)
        raise BenchError(f"the log could not be read to its end within {timeout_s:.0f} s")

    def ready_workers(self) -> int:
        """Workers ready with partitions of their own (in their group)."""
        return sum(1 for state, parts in self.beats.values() if state == "ready" and parts)

    def batch_times(self) -> tuple[list[float], list[float]]:
        """When batch tasks were sent, and when batch generations ended (sorted)."""
        batch = [k for k in self.sent if k.startswith("batch_")]
        return sorted(self.sent[k] for k in batch), sorted(self.ended[k] for k in batch
                                                           if k in self.ended)

    def steps(self) -> list[tuple[float, int, int]]:
        """(t, batch, interactive) generations in flight from t on."""
        if not self._steps:
            moves = sorted([(t, k.startswith("batch_"), 1) for k, t in self.sent.items()] +
                           [(self.ended[k], k.startswith("batch_"), -1)
                            for k in self.sent if k in self.ended])
            counts = [0, 0]  # interactive, batch
            self._steps = [(-math.inf, 0, 0)]
            for t, is_batch, d in moves:
                counts[is_batch] += d
                self._steps.append((t, counts[1], counts[0]))
        return self._steps

    def at(self, t: float) -> tuple[int, int]:
        """(batch, interactive) generations in flight at ``t``."""
        steps = self.steps()
        i = bisect.bisect_right(steps, (t, math.inf, math.inf)) - 1
        return steps[i][1], steps[i][2]

    def mean_batch(self, t0: float, t1: float) -> float:
        """Batch generations in flight on average (over time) from t0 to t1."""
        points = [t0, *(t for t, _, _ in self.steps() if t0 < t < t1), t1]
        return sum(self.at(a)[0] * (b - a) for a, b in itertools.pairwise(points)) / (t1 - t0)

    def worker_full(self, key: str) -> bool:
        """The worker ``key``'s task went to had every slot taken when it was sent."""
        t, owner = self.sent[key], self.owner.get(self.partition[key])
        return sum(1 for k, s in self.sent.items() if k != key and s <= t < self.ended.get(
            k, math.inf) and self.owner.get(self.partition[k]) == owner) >= CAPACITY

    def max_batch(self, t0: float, t1: float) -> int:
        return max([self.at(t0)[0], *(b for t, b, _ in self.steps() if t0 <= t <= t1)])


class CpuMeter:
    """CPU seconds used so far by each process (from /proc), and by the machine."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        for pid in filter(str.isdigit, os.listdir("/proc")):  # the shared broker, if found
            with contextlib.suppress(OSError):
                if b"kafka.Kafka" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    self.pids["kafka broker"] = int(pid)

    def read(self) -> dict[str, float]:
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[str, float] = {}
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        jiffies = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        out["machine (everything)"] = (sum(jiffies[:8]) - jiffies[3] - jiffies[4]) / tick
        return out


def cpu_since(meter: CpuMeter, before: dict[str, float], into: dict[str, float]) -> None:
    for name, used in meter.read().items():
        into[name] = into.get(name, 0.0) + used - before.get(name, used)
