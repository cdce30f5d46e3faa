"""Two ways to serve the same requests, measured side by side in one run.

Every comparison benchmark (``bench.overhead``: the upstream called directly
against Conveyor; ``bench.auth_overhead``: auth none against keys;
``bench.stream_overhead``: streams without ids or metrics against the
defaults) sends the same streaming completions to a *base* and a *variant*
side and reports the difference. The machine is shared and noisy, so the
figures are paired: at concurrency 1 each request of one side is followed by
one of the other, and at concurrency N a round of N streams of one side by a
round of the other. Which side goes first alternates from pair to pair and
from round to round (A B, B A, ...): work a side does after its answer has
ended (settling, metrics) would otherwise be billed to the side after it.
"""

from __future__ import annotations

import asyncio
import math
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from bench.client import Sample
from bench.harness import (
    BenchError,
    check_infra,
    check_port_free,
    conveyor_script,
    exit_on_sigterm,
    running,
    wait_http,
)
from bench.scenarios import DELAY_MS, TOKENS, Result, Scenario, Side, Tally
from bench.stats import Check, markdown_table, percentile

__all__ = ["REGISTRY", "Comparison", "CpuReader", "FineCheck", "Stage", "cpu_rows",
           "first_success", "loop_factory", "measure", "median_interval", "plan", "report_main",
           "report_summary", "run_pairs", "run_rounds", "staged"]

T = TypeVar("T")

# the models of a comparison of two Conveyor gateways over the upstream fixture
REGISTRY = "\n".join(
    f'[models."{name}"]\npool = "bench"\ncontext_length = 8192\ndefault_max_tokens = 64\n'
    f'tokenizer = "estimate"\nupstream_model = "{upstream}"\n'
    for name, upstream in (("bench-paced", f"bench@{DELAY_MS}"), ("bench-unpaced", "bench@0")))


def plan(quick: bool, rounds: int = 20) -> list[Scenario]:
    """The scenarios of a comparison of two Conveyor gateways: the paced c=1 TTFT
    and the unpaced c=32 rate, the pipeline's own limit, over ``rounds`` pairs of
    rounds of 128 requests (at about 300 req/s a pair takes about a second; the
    median ratio's interval narrows with the square root of their number)."""
    paced = f"{TOKENS} tokens x {DELAY_MS} ms"
    unpaced = f"concurrency 32, {TOKENS} tokens unpaced"
    if quick:
        return [Scenario("c1-paced", f"concurrency 1, {paced}", 1, True, 4, 60, 25.0),
                Scenario("c32-unpaced", unpaced, 32, False, 2, 512, 4.0, 2)]
    return [Scenario("c1-paced", f"concurrency 1, {paced}", 1, True, 20, 300, 120.0),
            Scenario("c32-unpaced", unpaced, 32, False, 2, 128 * rounds, 1.5 * rounds, 4)]


@dataclass(frozen=True)
class Comparison:
    """What is compared: the sides' names, the report's title, the targets."""

    base: str
    variant: str
    title: str
    checks: Callable[[Result], list[Check]]
    fine: bool = False  # TTFT p50 with two decimals (targets of about 1 ms)


class FineCheck(Check):
    """A check whose figure needs two decimals (a target of 1 ms)."""

    def measured(self) -> str:
        return "-" if math.isnan(self.value) else f"{self.value:.2f} {self.unit}"


def paired_checks(base: str, variant: str, ttft_target_ms: float, rate_target: float
                  ) -> Callable[[Result], list[Check]]:
    """The checks of a comparison of two Conveyor configurations (``plan``): the
    paired TTFT difference at c=1 and the variant's share of the base's c=32 rate."""

    def checks(result: Result) -> list[Check]:
        key = result.scenario.key
        if key == "c1-paced":
            added = percentile(result.added_ttft(), 50) * 1000
            return [FineCheck(key, f"added TTFT p50 ({variant} - {base}, paired)", added,
                              ttft_target_ms, "<=", "ms")]
        base_rate, variant_rate = result.base.rate, result.variant.rate
        ratios = result.rate_ratios()
        low, high = median_interval(ratios)
        interval = "too few for an interval" if math.isnan(low) else \
            f"95 % interval {100 * low:.1f}-{100 * high:.1f} %"
        return [Check(key, f"{variant} rate (>= {rate_target:.0%} of {base}'s "
                      f"{base_rate:.1f})", variant_rate, round(rate_target * base_rate, 1),
                      ">=", "req/s"),
                Check(key, f"{variant} rate over {base}'s, median of {len(ratios)} round "
                      f"pairs ({interval})",
                      round(100 * percentile(ratios, 50), 1), round(100 * rate_target, 1),
                      ">=", "%")]

    return checks


# -- the stage every comparison starts from -----------------------------------------


@dataclass(frozen=True)
class Stage:
    """The ``conveyor`` script, the run's folder (logs), its model registry and
    the upstream fixture's URL, serving."""

    script: Path
    work: Path
    models: Path
    upstream_url: str


@contextmanager
def staged(upstream_port: int, ports: dict[int, str], registry: str = REGISTRY
           ) -> Iterator[tuple[Stage, ExitStack]]:
    """Kafka and Redis answer and the ``ports`` (port -> what) are free; the
    upstream fixture serves on ``upstream_port``. What the caller starts on the
    stack is stopped with the upstream when the block ends."""
    check_infra()
    for port, what in {upstream_port: "upstream", **ports}.items():
        check_port_free(port, what)
    script = conveyor_script()
    work = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    print(f"logs and registry in {work}", flush=True)
    models = work / "models.toml"
    models.write_text(registry)
    url = f"http://127.0.0.1:{upstream_port}"
    argv = [sys.executable, "-m", "bench.upstream", "--port", str(upstream_port),
            "--tokens", str(TOKENS), "--delay-ms", str(DELAY_MS)]
    with ExitStack() as stack:
        upstream = stack.enter_context(running("upstream", argv, work))
        wait_http(f"{url}/v1/models", upstream, 30.0)
        yield Stage(script, work, models, url), stack


def report_main(prog: str, comparison: Comparison, run: Callable[[], list[Result]]) -> None:
    """Run a comparison as a script: SIGTERM stops its processes, a failure to
    set it up exits 2 with the reason, the summary tables come last."""
    exit_on_sigterm()
    try:
        results = run()
    except BenchError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    print()
    report_summary(results, comparison)


# -- measurement -------------------------------------------------------------------


async def first_success(side: Side, timeout_s: float) -> None:
    """A pipeline's first request can fail while its consumers join their groups."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while time.monotonic() < deadline:
        sample = await side.one(paced=False)
        if sample.ok:
            return
        last = sample.error or ""
        await asyncio.sleep(0.5)
    raise BenchError(f"{side.name}: no successful request within {timeout_s:.0f} s: {last}")


async def _timed(side: Side, paced: bool, tally: Tally) -> Sample:
    start = time.perf_counter()
    sample = await side.one(paced)
    tally.samples.append(sample)
    tally.busy_s += time.perf_counter() - start
    return sample


async def _in_turn(i: int, base_step: Callable[[], Awaitable[T]],
                   variant_step: Callable[[], Awaitable[T]]) -> tuple[T, T]:
    """Both steps, the base side's first when ``i`` is even: (base, variant)."""
    if i % 2 == 0:
        b = await base_step()
        return b, await variant_step()
    v = await variant_step()
    return await base_step(), v


async def run_pairs(sc: Scenario, base: Side, variant: Side) -> Result:
    """Concurrency 1: pairs of one request a side, the first side alternating."""
    result = Result(sc)
    for _ in range(sc.warmup):
        await base.one(sc.paced)
        await variant.one(sc.paced)
    for i in range(sc.max_requests):
        if max(result.base.busy_s, result.variant.busy_s) >= sc.window_s:
            break
        result.pairs.append(await _in_turn(
            i, lambda: _timed(base, sc.paced, result.base),
            lambda: _timed(variant, sc.paced, result.variant)))
    return result


# CPU seconds each process has used so far, by name (bench/profile.py's cpu_reader)
CpuReader = Callable[[], dict[str, float]]


async def _round(sc: Scenario, side: Side, tally: Tally | None, per_worker: int,
                 cpu: CpuReader | None = None) -> list[Sample]:
    """``sc.concurrency`` streams, each sending ``per_worker`` requests back to back."""

    async def lane() -> list[Sample]:
        return [await side.one(sc.paced) for _ in range(per_worker)]

    used = cpu() if cpu is not None and tally is not None else {}
    start = time.perf_counter()
    lanes = await asyncio.gather(*(lane() for _ in range(sc.concurrency)))
    samples = [one[i] for i in range(per_worker) for one in lanes]
    if tally is not None:
        took = time.perf_counter() - start
        tally.samples.extend(samples)
        tally.busy_s += took
        tally.round_rates.append(sum(s.ok for s in samples) / took)
        if cpu is not None:
            # what the processes did after the round's last answer (settling,
            # accounting) lands in the next round, of either side: which side
            # goes first alternates
            for name, seconds in cpu().items():
                tally.cpu_s[name] = tally.cpu_s.get(name, 0.0) + seconds - used.get(name, 0.0)
    return samples


async def run_rounds(sc: Scenario, base: Side, variant: Side,
                     cpu: CpuReader | None = None) -> Result:
    """Concurrency N: a round of N streams a side, the first side alternating;
    with ``cpu``, each process's CPU during each side's rounds."""
    result = Result(sc)
    for _ in range(sc.warmup):
        await _round(sc, base, None, 1)
        await _round(sc, variant, None, 1)
    i = 0
    while (max(len(result.base.samples), len(result.variant.samples)) < sc.max_requests
           and max(result.base.busy_s, result.variant.busy_s) < sc.window_s):
        b, v = await _in_turn(i, lambda: _round(sc, base, result.base, sc.per_worker, cpu),
                              lambda: _round(sc, variant, result.variant, sc.per_worker, cpu))
        result.pairs.extend(zip(b, v, strict=True))
        i += 1
    return result


async def measure(scenarios: list[Scenario], base: Side, variant: Side,
                  comparison: Comparison, first_timeout_s: float = 90.0,
                  cpu: CpuReader | None = None) -> list[Result]:
    """Each scenario in turn, its report printed as it ends (with ``cpu``, the
    concurrent scenarios' CPU a request, process by process)."""
    await first_success(base, first_timeout_s)
    await first_success(variant, first_timeout_s)
    results: list[Result] = []
    for sc in scenarios:
        print(f"running {sc.key}: {sc.title} ...", flush=True)
        running = run_pairs(sc, base, variant) if sc.concurrency == 1 else \
            run_rounds(sc, base, variant, cpu)
        try:
            result = await asyncio.wait_for(running, sc.hard_limit_s)
        except TimeoutError as exc:
            raise BenchError(f"{sc.key} ran past {sc.hard_limit_s:.0f} s") from exc
        report_scenario(result, comparison)
        results.append(result)
    return results


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (as the gateway runs on it)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


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


def _ms(seconds: float, fine: bool) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.{2 if fine else 1}f}"


def _side_row(sc: Scenario, name: str, tally: Tally, fine: bool) -> list[str]:
    ttft = [s.ttft for s in tally.ok]
    total = [s.total for s in tally.ok]
    return [sc.key, name,
            f"{len(tally.ok)}" + (f" (+{len(tally.failed)} failed)" if tally.failed else ""),
            _ms(percentile(ttft, 50), fine), _ms(percentile(ttft, 99), False),
            _ms(percentile(total, 50), False), _ms(percentile(total, 99), False),
            "-" if math.isnan(tally.rate) else f"{tally.rate:.1f}"]


def _added_row(result: Result, fine: bool) -> list[str]:
    added = result.added_ttft()
    added_total = [v.total - b.total for b, v in result.pairs if b.ok and v.ok]
    rate = ""
    if result.base.rate > 0 and not math.isnan(result.variant.rate):
        rate = f"{100 * (result.variant.rate / result.base.rate - 1):+.1f} %"
    return [result.scenario.key, "added (paired)", str(len(added)),
            _ms(percentile(added, 50), fine), _ms(percentile(added, 99), False),
            _ms(percentile(added_total, 50), fine), _ms(percentile(added_total, 99), False),
            rate]


def _rows(result: Result, c: Comparison) -> list[list[str]]:
    sc = result.scenario
    return [_side_row(sc, c.base, result.base, c.fine),
            _side_row(sc, c.variant, result.variant, c.fine), _added_row(result, c.fine)]


HEADER = ["scenario", "side", "requests", "TTFT p50 ms", "TTFT p99 ms", "total p50 ms",
          "total p99 ms", "req/s"]


def report_scenario(result: Result, c: Comparison) -> None:
    sc = result.scenario
    print(f"\n== {sc.key}: {sc.title} ==")
    print(markdown_table(HEADER, _rows(result, c)))
    added = result.added_ttft()
    low, high = median_interval(added)
    print(f"added TTFT ({c.variant} - {c.base}, {len(added)} pairs): "
          f"p50 {_ms(percentile(added, 50), c.fine)} ms (95% interval "
          f"[{_ms(low, c.fine)}, {_ms(high, c.fine)}]), p99 {_ms(percentile(added, 99), False)} ms")
    expected = TOKENS * len(" tok")
    for tally, name in ((result.base, c.base), (result.variant, c.variant)):
        short = [s for s in tally.ok if s.chars != expected]
        if short:
            print(f"warning: {len(short)} {name} streams had {short[0].chars} characters, "
                  f"not {expected}")
        if tally.failed:
            print(f"{name}: {len(tally.failed)} failed, first: {tally.failed[0].error}")
    if result.base.cpu_s:
        print("\nCPU a request during each side's rounds (µs; the variant's extra):")
        print(markdown_table(["process", c.base, c.variant, "extra"], cpu_rows(result)))
    for check in c.checks(result):
        print(check.line())
    print(flush=True)


def cpu_rows(result: Result) -> list[list[str]]:
    """Per process (most CPU first) and in all: µs a request on each side."""
    b_n, v_n = max(1, len(result.base.ok)), max(1, len(result.variant.ok))
    names = sorted(result.base.cpu_s, key=lambda n: -result.base.cpu_s[n])
    rows = []
    for name in [*names, "all"]:
        if name == "all":
            b, v = sum(result.base.cpu_s.values()), sum(result.variant.cpu_s.values())
        else:
            b, v = result.base.cpu_s[name], result.variant.cpu_s.get(name, 0.0)
        b_us, v_us = 1e6 * b / b_n, 1e6 * v / v_n
        rows.append([name, f"{b_us:.0f}", f"{v_us:.0f}", f"{v_us - b_us:+.0f}"])
    return rows


def report_summary(results: list[Result], c: Comparison) -> None:
    rows = [row for result in results for row in _rows(result, c)]
    found = [check for result in results for check in c.checks(result)]
    print(f"## {c.title}\n")
    print(markdown_table(HEADER, rows))
    print()
    print(markdown_table(
        ["scenario", "figure", "measured", "target", "met"],
        [[k.scenario, k.label, k.measured(), k.target(), "yes" if k.met else "no"]
         for k in found]))
