"""Two ways to serve the same streamed completions, measured side by side in
one run, paired: at concurrency 1 request by request, at concurrency N round
by round, the first side alternating (A B, B A, ...) so that work a side does
after its answer is not billed to the side after it.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from bench.client import Sample, StreamClient, first_success, stream_completion
from bench.harness import DELAY_MS, TOKENS, BenchError, Pipeline
from bench.stats import Check, check_table, markdown_table, ms, percentile

__all__ = ["Result", "Scenario", "Side", "Tally", "measure", "median_interval",
           "report_summary", "run_rounds", "sides"]

T = TypeVar("T")

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


@dataclass
class Side:
    """One way to reach the engine: an endpoint, a model name per pacing, a client."""

    name: str
    url: str
    models: dict[bool, str]  # paced? -> model name
    client: StreamClient
    max_tokens: int = TOKENS

    async def one(self, paced: bool) -> Sample:
        body = {"model": self.models[paced], "prompt": PROMPT, "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True}
        return await stream_completion(self.client, self.url, body)


@asynccontextmanager
async def sides(stage: Pipeline, connections: int, paces_ms: dict[bool, int] | None = None,
                max_tokens: int = TOKENS,
                timeout_s: float = 30.0) -> AsyncIterator[tuple[Side, Side]]:
    """The upstream called directly and Conveyor in front of it, each with a client
    of its own: for paced and unpaced (``paces_ms``), the fixture's ``bench@<ms>``
    and Conveyor's ``bench-<ms>``."""
    paces = paces_ms or {True: DELAY_MS, False: 0}
    async with StreamClient(connections, timeout_s) as direct, \
            StreamClient(connections, timeout_s) as through:
        yield (Side("direct", f"{stage.upstream_url}/v1/completions",
                    {paced: f"bench@{ms}" for paced, ms in paces.items()}, direct, max_tokens),
               Side("conveyor", f"{stage.gateway_url}/v1/completions",
                    {paced: f"bench-{ms}" for paced, ms in paces.items()}, through, max_tokens))


@dataclass
class Tally:
    """A side's recorded requests, the wall time spent sending them and, where
    measured, the CPU each watched process spent meanwhile."""

    name: str = ""  # the side's
    samples: list[Sample] = field(default_factory=list)
    busy_s: float = 0.0
    # concurrency N: each round's rate (its answered streams over its wall time)
    round_rates: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process label
    cpu: Callable[[], dict[str, float]] = dict  # the watched processes' CPU seconds so far

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def failed(self) -> list[Sample]:
        return [s for s in self.samples if not s.ok]

    @property
    def rate(self) -> float:
        return len(self.ok) / self.busy_s if self.busy_s > 0 else math.nan

    @property
    def tokens(self) -> int:
        """The fixture's tokens the answered streams carried (``" tok"`` each)."""
        return sum(s.chars // len(" tok") for s in self.ok)

    def cpu_ms_per_token(self, label: str) -> float:
        return 1000 * self.cpu_s.get(label, 0.0) / self.tokens if self.tokens else math.nan


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


Checks = Callable[[Result], list[Check]]  # a scenario's targets


# -- measurement -------------------------------------------------------------------


async def _in_turn(i: int, base_step: Callable[[], Awaitable[T]],
                   variant_step: Callable[[], Awaitable[T]]) -> tuple[T, T]:
    """Both steps, the base side's first when ``i`` is even: (base, variant)."""
    if i % 2 == 0:
        b = await base_step()
        return b, await variant_step()
    v = await variant_step()
    return await base_step(), v


async def _round(sc: Scenario, side: Side, tally: Tally | None, per_worker: int) -> list[Sample]:
    """``sc.concurrency`` streams, each sending ``per_worker`` requests back to back."""

    async def lane() -> list[Sample]:
        return [await side.one(sc.paced) for _ in range(per_worker)]

    before = tally.cpu() if tally is not None else {}
    start = time.perf_counter()
    lanes = await asyncio.gather(*(lane() for _ in range(sc.concurrency)))
    samples = [one[i] for i in range(per_worker) for one in lanes]
    if tally is not None:
        took = time.perf_counter() - start
        tally.samples.extend(samples)
        tally.busy_s += took
        if sc.concurrency > 1:  # one request a side: pairs, no rounds
            tally.round_rates.append(sum(s.ok for s in samples) / took)
        for label, spent in tally.cpu().items():
            tally.cpu_s[label] = tally.cpu_s.get(label, 0.0) + spent - before.get(label, 0.0)
    return samples


async def run_rounds(sc: Scenario, base: Side, variant: Side,
                     cpu: Callable[[], dict[str, float]] = dict) -> Result:
    """A round of N streams a side, the first side alternating (at concurrency
    1, pairs of one request a side); ``cpu``: what the tallies measure the
    processes' CPU with."""
    result = Result(sc, Tally(base.name, cpu=cpu), Tally(variant.name, cpu=cpu))
    for _ in range(sc.warmup):
        await _round(sc, base, None, 1)
        await _round(sc, variant, None, 1)
    i = 0
    while (max(len(result.base.samples), len(result.variant.samples)) < sc.max_requests
           and max(result.base.busy_s, result.variant.busy_s) < sc.window_s):
        b, v = await _in_turn(i, lambda: _round(sc, base, result.base, sc.per_worker),
                              lambda: _round(sc, variant, result.variant, sc.per_worker))
        result.pairs.extend(zip(b, v, strict=True))
        i += 1
    return result


async def measure(scenarios: list[Scenario], base: Side, variant: Side, checks: Checks,
                  first_timeout_s: float = 90.0) -> list[Result]:
    """Each scenario in turn, its report printed as it ends."""
    for side in (base, variant):
        await first_success(side.name, functools.partial(side.one, False), first_timeout_s)
    results: list[Result] = []
    for sc in scenarios:
        print(f"running {sc.key}: {sc.title} ...", flush=True)
        limit_s = 2 * sc.window_s + 120.0
        try:
            result = await asyncio.wait_for(run_rounds(sc, base, variant), limit_s)
        except TimeoutError as exc:
            raise BenchError(f"{sc.key} ran past {limit_s:.0f} s") from exc
        report_scenario(result, checks)
        results.append(result)
    return results


# -- reporting ---------------------------------------------------------------------


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free ~95 % confidence interval of the median (order
    statistics n/2 -+ 0.98 sqrt(n)); NaN when there are too few values."""
    n = len(values)
    if n < 10:
        return math.nan, math.nan
    ordered = sorted(values)
    half = 0.98 * math.sqrt(n)
    return ordered[max(0, math.floor(n / 2 - half))], ordered[min(n - 1, math.ceil(n / 2 + half))]


def _side_row(sc: Scenario, tally: Tally) -> list[str]:
    ttft = [s.ttft for s in tally.ok]
    total = [s.total for s in tally.ok]
    return [sc.key, tally.name,
            f"{len(tally.ok)}" + (f" (+{len(tally.failed)} failed)" if tally.failed else ""),
            ms(percentile(ttft, 50)), ms(percentile(ttft, 99)),
            ms(percentile(total, 50)), ms(percentile(total, 99)),
            "-" if math.isnan(tally.rate) else f"{tally.rate:.1f}"]


def _added_row(result: Result) -> list[str]:
    added = result.added_ttft()
    added_total = [v.total - b.total for b, v in result.pairs if b.ok and v.ok]
    rate = ""
    if result.base.rate > 0 and not math.isnan(result.variant.rate):
        rate = f"{100 * (result.variant.rate / result.base.rate - 1):+.1f} %"
    return [result.scenario.key, "added (paired)", str(len(added)),
            ms(percentile(added, 50)), ms(percentile(added, 99)),
            ms(percentile(added_total, 50)), ms(percentile(added_total, 99)), rate]


def _rows(result: Result) -> list[list[str]]:
    sc = result.scenario
    return [_side_row(sc, result.base), _side_row(sc, result.variant), _added_row(result)]


HEADER = ["scenario", "side", "requests", "TTFT p50 ms", "TTFT p99 ms", "total p50 ms",
          "total p99 ms", "req/s"]


def report_scenario(result: Result, checks: Checks) -> None:
    sc, base, variant = result.scenario, result.base.name, result.variant.name
    print(f"\n== {sc.key}: {sc.title} ==")
    print(markdown_table(HEADER, _rows(result)))
    added = result.added_ttft()
    low, high = median_interval(added)
    print(f"added TTFT ({variant} - {base}, {len(added)} pairs): "
          f"p50 {ms(percentile(added, 50))} ms (95% interval [{ms(low)}, {ms(high)}]), "
          f"p99 {ms(percentile(added, 99))} ms")
    ratios = result.rate_ratios()
    low, high = median_interval(ratios)
    if not math.isnan(low):
        print(f"{variant} rate over {base}'s, median of {len(ratios)} round pairs: "
              f"{100 * percentile(ratios, 50):.1f} % (95 % interval {100 * low:.1f}-"
              f"{100 * high:.1f} %)")
    expected = TOKENS * len(" tok")
    for tally in (result.base, result.variant):
        short = [s for s in tally.ok if s.chars != expected]
        if short:
            print(f"warning: {len(short)} {tally.name} streams had {short[0].chars} "
                  f"characters, not {expected}")
        if tally.failed:
            print(f"{tally.name}: {len(tally.failed)} failed, first: {tally.failed[0].error}")
    for check in checks(result):
        print(check.line())
    print(flush=True)


def report_summary(results: list[Result], title: str, checks: Checks) -> None:
    rows = [row for result in results for row in _rows(result)]
    found = [check for result in results for check in checks(result)]
    print(f"## {title}\n")
    print(markdown_table(HEADER, rows))
    print()
    print(check_table(found))
