"""What ``python -m bench.batch`` measured and how it prints it: a batch as its
client saw it, the interactive scenarios, and the tables and checks of the
report (the run itself is in bench/batch.py)."""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field

from bench.batch_log import CAPACITY, WORKERS, CpuMeter, InFlight
from bench.hops import HOPS
from bench.scenarios import TOKENS, Tally
from bench.stats import Check, markdown_table, ms, percentile
from conveyor.settings import Settings

__all__ = ["BatchRun", "Interactive", "Figures", "report", "CONCURRENCY", "SLOTS"]

CONCURRENCY = 4
SLOTS = WORKERS * CAPACITY
TTFT_SLACK, CAPACITY_TARGET = 0.15, 0.90


@dataclass
class BatchRun:
    """A batch as its client sees it: (time, status, completed, failed) every poll."""

    id: str
    total: int
    created: float
    timeline: list[tuple[float, str, int, int]] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.timeline[-1][1] if self.timeline else "validating"

    @property
    def done(self) -> int:
        return sum(self.timeline[-1][2:]) if self.timeline else 0

    @property
    def final(self) -> bool:
        return self.status in ("completed", "failed", "cancelled", "expired")

    def took(self) -> float:
        """Seconds from create to the status now seen."""
        return next(t for t, s, _, _ in self.timeline if s == self.status) - self.created


@dataclass
class Interactive:
    """A scenario's streamed requests and the time windows they ran in."""

    name: str
    tally: Tally = field(default_factory=Tally)
    windows: list[tuple[float, float]] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds


@dataclass
class Figures:
    delay_ms: int
    settings: Settings
    meter: CpuMeter
    batch_cpu: dict[str, float] = field(default_factory=dict)  # batch alone, CPU seconds
    alone_batch: BatchRun | None = None
    beside_batch: BatchRun | None = None
    halves: list[Interactive] = field(default_factory=list)
    beside: Interactive = field(default_factory=lambda: Interactive("interactive + batch"))
    beside_done: tuple[int, int] = (0, 0)  # the batch's lines done at the start and the end

    @property
    def line_s(self) -> float:
        return TOKENS * self.delay_ms / 1000

    @property
    def cap(self) -> int:
        return math.floor(SLOTS * self.settings.batch_max_share + 1e-9)



def _row(scenario: Interactive) -> list[str]:
    tally = scenario.tally
    ttft, total = [s.ttft for s in tally.ok], [s.total for s in tally.ok]
    return [scenario.name,
            f"{len(tally.ok)}" + (f" (+{len(tally.failed)} failed)" if tally.failed else ""),
            ms(percentile(ttft, 50)), ms(percentile(ttft, 99)), ms(percentile(total, 50)),
            "-" if math.isnan(tally.rate) else f"{tally.rate:.1f}"]


def alone_batch_lines(f: Figures, flight: InFlight) -> tuple[list[str], float]:
    """The alone batch's figures, and its share of the workers' capacity (%)."""
    a, b = f.alone_batch, f.beside_batch
    if a is None or not a.final or b is None:
        return [], math.nan
    capacity = SLOTS / f.line_s
    share = 100 * a.done / a.took() / capacity
    sent, ended = flight.batch_times()
    first = min(t for t in sent if t >= a.created)
    last = max(t for t in ended if a.created <= t < b.created)
    waves = math.ceil(a.total / SLOTS)
    return [f"batch alone: {a.done} of {a.total} lines {a.status} in {a.took():.2f} s from "
            f"create: {a.done / a.took():.1f} lines/s = {share:.1f} % of the workers' capacity "
            f"({WORKERS} x {CAPACITY} slots / ({TOKENS} tokens x {f.delay_ms} ms) = "
            f"{capacity:.1f} lines/s)",
            f"  create -> first task sent {first - a.created:.2f} s; generations "
            f"{last - first:.2f} s (ideal: {waves} waves x {f.line_s:.2f} s = "
            f"{waves * f.line_s:.2f} s); last end -> completed seen "
            f"{a.created + a.took() - last:.2f} s; batch generations in flight on average "
            f"{flight.mean_batch(first, last):.1f} of {SLOTS}"], share


def beside_batch_lines(f: Figures, flight: InFlight) -> list[str]:
    """How far the second batch got beside the interactive load, and what the
    interactive tasks found when schedule sent them."""
    b = f.beside_batch
    if b is None or not f.beside.windows:
        return []
    t0, t1 = f.beside.windows[0]
    rate = (f.beside_done[1] - f.beside_done[0]) / (t1 - t0)
    keys = [k for k, t in flight.sent.items() if t0 <= t <= t1 and not k.startswith("batch_")]
    full = sum(1 for k in keys if sum(flight.at(flight.sent[k] - 1e-6)) >= SLOTS)
    lines = [k for k in flight.sent if k.startswith("batch_")]

    def chunks(ks: list[str]) -> float:
        return sum(flight.chunks[k] for k in ks) / max(1, len(ks))

    return [f"batch beside interactive: {f.beside_done[0]} -> {f.beside_done[1]} of {b.total} "
            f"lines done while the interactive load ran, {rate:.1f} lines/s = "
            f"{100 * rate * f.line_s / SLOTS:.1f} % of capacity (cap while interactive traffic "
            f"is around: {f.cap} of {SLOTS} slots); {b.status} {b.took():.2f} s after create",
            f"  batch generations in flight meanwhile: {flight.mean_batch(t0, t1):.1f} on "
            f"average, at most {flight.max_batch(t0, t1)}; interactive tasks sent to a full "
            f"pool: {full}, to a full worker: {sum(map(flight.worker_full, keys))}, of "
            f"{len(keys)}",
            f"  chunks on conveyor.tokens: {chunks(lines):.1f} a batch line, "
            f"{chunks(keys):.1f} an interactive request"]


def hop_table(scenarios: list[Interactive], flight: InFlight) -> str:
    """p50 of each hop between layer stamps of the interactive requests of each
    scenario (requests whose gateway stamp falls in one of its windows), ms."""
    rows: list[list[str]] = []
    picked = [[s for rid, s in flight.stamps.items() if all(h in s for h in HOPS) and any(
        w0 <= s["gateway"] / 1e6 <= w1 for w0, w1 in sc.windows)] for sc in scenarios]
    for x, y in [*itertools.pairwise(HOPS), (HOPS[0], HOPS[-1])]:
        rows.append([f"{x} -> {y}", *(f"{percentile([(s[y] - s[x]) / 1000 for s in got], q):.1f}"
                                      for got in picked for q in (50, 90))])
    header = ["hop (ms)", *(f"{sc.name} {q}" for sc in scenarios for q in ("p50", "p90"))]
    counts = ", ".join(f"{sc.name}: {len(got)}" for sc, got in zip(scenarios, picked, strict=True))
    return f"{markdown_table(header, rows)}\n(requests with every stamp: {counts})"


def cpu_table(f: Figures, both: Interactive) -> str:
    """Cores busy (CPU seconds a second) per process, in each scenario."""
    spans = [(f.batch_cpu, f.alone_batch.took() if f.alone_batch else math.nan),
             *((sc.cpu, sc.tally.busy_s) for sc in (both, f.beside))]
    names = sorted({n for cpu, _ in spans for n in cpu}, key=lambda n: n.startswith("machine"))
    rows = [[n, *(f"{cpu[n] / span:.2f}" if n in cpu else "-" for cpu, span in spans)]
            for n in names]
    return markdown_table(["cores busy", "batch alone", both.name, f.beside.name], rows)


def report(f: Figures, flight: InFlight) -> None:
    both = Interactive("interactive alone (both)")
    for half in f.halves:
        both.tally.samples += half.tally.samples
        both.tally.busy_s += half.tally.busy_s
        both.windows += half.windows
        for name, used in half.cpu.items():
            both.cpu[name] = both.cpu.get(name, 0.0) + used
    scenarios = [*f.halves, both, f.beside]
    s = f.settings
    print(f"\n## Batch beside interactive traffic ({WORKERS} workers x capacity {CAPACITY}, "
          f"{TOKENS} tokens x {f.delay_ms} ms, concurrency {CONCURRENCY}, batch_max_share "
          f"{s.batch_max_share}, batch_prefetch {s.batch_prefetch}, interactive_linger_s "
          f"{s.interactive_linger_s}; load average {os.getloadavg()[0]:.2f} at the end)\n")
    print(markdown_table(["scenario", "requests", "TTFT p50 ms", "TTFT p99 ms", "total p50 ms",
                          "req/s"], [_row(sc) for sc in scenarios]))
    lines, share = alone_batch_lines(f, flight)
    print("\n" + "\n".join(lines + beside_batch_lines(f, flight)) + "\n")
    print(hop_table([both, f.beside], flight))
    print("\n" + cpu_table(f, both))
    for sc in scenarios:
        if sc.tally.failed:
            print(f"{sc.name}: {len(sc.tally.failed)} failed, first: {sc.tally.failed[0].error}")
    alone_p50 = percentile([x.ttft for x in both.tally.ok], 50) * 1000
    checks = [
        Check("interactive + batch", f"TTFT p50 (within {TTFT_SLACK:.0%} of alone's "
              f"{alone_p50:.1f} ms)", percentile([x.ttft for x in f.beside.tally.ok], 50) * 1000,
              round((1 + TTFT_SLACK) * alone_p50, 1), "<=", "ms"),
        Check("batch alone", "throughput, share of the workers' capacity", share,
              100 * CAPACITY_TARGET, ">=", "%")]
    print("\n" + markdown_table(["scenario", "figure", "measured", "target", "met"],
                                [[c.scenario, c.label, c.measured(), c.target(),
                                  "yes" if c.met else "no"] for c in checks]))

