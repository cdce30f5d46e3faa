"""The overhead benchmark's scenarios, and how each runs its requests: in
alternating direct/Conveyor pairs at concurrency 1, in alternating rounds of
concurrent streams otherwise (see ``bench.overhead``)."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import httpx

from bench.client import Sample, stream_completion
from bench.stats import Check, percentile

__all__ = ["DELAY_MS", "PROMPT", "TOKENS", "Result", "Scenario", "Side", "Tally", "run_rounds",
           "run_serial", "scenarios"]

TOKENS = 32
DELAY_MS = 10
PROMPT = "Write one short sentence about conveyor belts."


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    concurrency: int
    paced: bool
    warmup: int  # pairs at concurrency 1, rounds otherwise
    max_requests: int  # a side, after warm-up
    window_s: float  # a side's busy time, after warm-up
    per_worker: int = 1  # requests each of the concurrent streams sends in one round

    @property
    def hard_limit_s(self) -> float:
        return 2 * self.window_s + 120.0


def scenarios(quick: bool) -> list[Scenario]:
    paced = f"{TOKENS} tokens x {DELAY_MS} ms"
    if quick:
        return [
            Scenario("c1-paced", f"concurrency 1, {paced}", 1, True, 4, 40, 30.0),
            Scenario("c32-paced", f"concurrency 32, {paced}", 32, True, 1, 200, 2.0, 2),
            Scenario(
                "c32-unpaced", f"concurrency 32, {TOKENS} tokens unpaced", 32, False, 1, 200, 2.0, 2
            ),
        ]
    return [
        Scenario("c1-paced", f"concurrency 1, {paced}", 1, True, 20, 200, 120.0),
        Scenario("c32-paced", f"concurrency 32, {paced}", 32, True, 1, 1000, 10.0, 4),
        Scenario(
            "c32-unpaced", f"concurrency 32, {TOKENS} tokens unpaced", 32, False, 1, 1000, 10.0, 4
        ),
    ]


@dataclass
class Side:
    """One way to reach the engine: an endpoint, a model name per pacing, a client."""

    name: str
    url: str
    models: dict[bool, str]  # paced? -> model name
    client: httpx.AsyncClient

    async def one(self, paced: bool) -> Sample:
        body = {
            "model": self.models[paced],
            "prompt": PROMPT,
            "max_tokens": TOKENS,
            "temperature": 0,
            "stream": True,
        }
        return await stream_completion(self.client, self.url, body)


@dataclass
class Tally:
    """A side's recorded requests and the wall time spent sending them."""

    samples: list[Sample] = field(default_factory=list)
    busy_s: float = 0.0

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def failed(self) -> list[Sample]:
        return [s for s in self.samples if not s.ok]

    @property
    def rate(self) -> float:
        return len(self.ok) / self.busy_s if self.busy_s > 0 else math.nan


@dataclass
class Result:
    scenario: Scenario
    direct: Tally = field(default_factory=Tally)
    conveyor: Tally = field(default_factory=Tally)
    pairs: list[tuple[Sample, Sample]] = field(default_factory=list)

    def added_ttft(self) -> list[float]:
        return [c.ttft - d.ttft for d, c in self.pairs if d.ok and c.ok]

    def checks(self) -> list[Check]:
        added = self.added_ttft()
        key = self.scenario.key
        if key == "c1-paced":
            return [
                Check(key, "added TTFT p50", percentile(added, 50) * 1000, 10, "<=", "ms"),
                Check(key, "added TTFT p99", percentile(added, 99) * 1000, 30, "<=", "ms"),
            ]
        if key == "c32-paced":
            return [
                # ~99 req/s in theory (32 streams x 320 ms); the client's own cost keeps
                # the direct side a little under that, so keep up with it within 5%.
                Check(
                    key,
                    "Conveyor rate (~99 ideal, >= 95% of direct)",
                    self.conveyor.rate,
                    round(0.95 * self.direct.rate, 1),
                    ">=",
                    "req/s",
                ),
                Check(key, "added TTFT p50", percentile(added, 50) * 1000, 20, "<=", "ms"),
            ]
        return [Check(key, "Conveyor streamed rate", self.conveyor.rate, 150, ">=", "req/s")]


# Measurement


async def _timed(side: Side, paced: bool, tally: Tally | None) -> Sample:
    start = time.perf_counter()
    sample = await side.one(paced)
    if tally is not None:
        tally.samples.append(sample)
        tally.busy_s += time.perf_counter() - start
    return sample


async def run_serial(sc: Scenario, direct: Side, conveyor: Side) -> Result:
    """Concurrency 1: direct, Conveyor, direct, Conveyor..."""
    result = Result(sc)
    for _ in range(sc.warmup):
        await direct.one(sc.paced)
        await conveyor.one(sc.paced)
    for _ in range(sc.max_requests):
        if max(result.direct.busy_s, result.conveyor.busy_s) >= sc.window_s:
            break
        d = await _timed(direct, sc.paced, result.direct)
        c = await _timed(conveyor, sc.paced, result.conveyor)
        result.pairs.append((d, c))
    return result


async def _round(sc: Scenario, side: Side, tally: Tally | None, per_worker: int) -> list[Sample]:
    """``sc.concurrency`` streams, each sending ``per_worker`` requests back to back."""

    async def stream_worker() -> list[Sample]:
        return [await side.one(sc.paced) for _ in range(per_worker)]

    start = time.perf_counter()
    lanes = await asyncio.gather(*(stream_worker() for _ in range(sc.concurrency)))
    samples = [lane[i] for i in range(per_worker) for lane in lanes]
    if tally is not None:
        tally.samples.extend(samples)
        tally.busy_s += time.perf_counter() - start
    return samples


async def run_rounds(sc: Scenario, direct: Side, conveyor: Side) -> Result:
    """Concurrency N: a round of N direct streams, then a round of N through Conveyor."""
    result = Result(sc)
    for _ in range(sc.warmup):
        await _round(sc, direct, None, 1)
        await _round(sc, conveyor, None, 1)
    while (
        max(len(result.direct.samples), len(result.conveyor.samples)) < sc.max_requests
        and max(result.direct.busy_s, result.conveyor.busy_s) < sc.window_s
    ):
        d = await _round(sc, direct, result.direct, sc.per_worker)
        c = await _round(sc, conveyor, result.conveyor, sc.per_worker)
        result.pairs.extend(zip(d, c, strict=True))
    return result
