"""The comparison benchmarks' scenarios, the sides they compare and what each
side recorded (how they run: ``bench.compare``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.client import Sample, StreamClient, stream_completion

__all__ = ["DELAY_MS", "PROMPT", "TOKENS", "Result", "Scenario", "Side", "Tally", "scenarios"]

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
    client: StreamClient
    # one prompt for every request, or a function that makes each request's
    prompt: str | Callable[[], str] = PROMPT

    async def one(self, paced: bool) -> Sample:
        body = {
            "model": self.models[paced],
            "prompt": self.prompt() if callable(self.prompt) else self.prompt,
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
    # concurrency N: each round's rate (its answered streams over its wall time)
    round_rates: list[float] = field(default_factory=list)
    # concurrency N, when the processes' CPU is read: CPU seconds each process
    # spent during this side's rounds
    cpu_s: dict[str, float] = field(default_factory=dict)

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
    """One scenario's requests on both sides, and the pairs they formed."""

    scenario: Scenario
    base: Tally = field(default_factory=Tally)
    variant: Tally = field(default_factory=Tally)
    pairs: list[tuple[Sample, Sample]] = field(default_factory=list)  # (base, variant)

    def rate_ratios(self) -> list[float]:
        """Concurrency N: the variant's rate over the base's, round pair by round
        pair (each pair ran back to back, so the machine's drift mostly cancels)."""
        return [v / b for b, v in zip(self.base.round_rates, self.variant.round_rates,
                                      strict=False) if b > 0]

    def added_ttft(self) -> list[float]:
        return [v.ttft - b.ttft for b, v in self.pairs if b.ok and v.ok]
