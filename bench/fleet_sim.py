"""Routing policies on a simulated fleet: random, least-loaded and prefix-aware,
side by side, from a few workers to many, below and past saturation.

    python -m bench.fleet_sim [--quick] [--workloads shared-prefix,chat]
        [--workers 8,32,128] [--rates 0.25,0.5,0.75,0.9,1.0,1.2] [--requests 10000]
        [--scale 1.0]

The routing is real (:func:`workers.prefix.choose` over a
:class:`~workers.prefix.PrefixIndex`); schedule's queue, the workers and the
workloads are simulated on a logical clock (:mod:`bench.fleet_sim_model`).
The model, how to read the tables and the checks: docs/benchmarks/index.md.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from heapq import heappop, heappush
from statistics import fmean
from typing import Literal

from bench import fleet_sim_model as sim
from bench.stats import Check, fmt, markdown_table, percentile
from workers.prefix import PrefixIndex, RoutePolicy, WorkerLoad, choose, load_limit

__all__ = ["POLICIES", "Cell", "FleetConfig", "Policy", "Result", "main", "simulate"]

Policy = Literal["random", "least-loaded", "prefix-aware"]
POLICIES: tuple[Policy, ...] = ("random", "least-loaded", "prefix-aware")


@dataclass(frozen=True)
class FleetConfig:
    workers: int
    spec: sim.WorkerSpec = field(default_factory=sim.WorkerSpec)
    model: sim.StepModel = field(default_factory=sim.StepModel)
    schedule_timeout_s: float = 5.0  # settings.schedule.timeout_s
    queue_max: int = 256  # settings.schedule.queue_max
    index_blocks: int = 4096  # settings.schedule.route_index_blocks
    index_ttl_s: float = 600.0  # settings.schedule.route_index_ttl_s
    segment_steps: int = 64  # a worker's iterations an event at most: speed only (Worker)


@dataclass(frozen=True)
class Result:
    policy: str
    arrived: int
    answered: int
    refused: int
    offered_rps: float  # requests that arrived / the time they arrived over
    cache_hit: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    max_load_ratio: float

    @property
    def refused_share(self) -> float:
        return self.refused / self.arrived if self.arrived else 0.0


@dataclass(frozen=True)
class Cell:
    workload: str
    workers: int
    load: float  # the rate as a fraction of the estimated capacity
    rate_rps: float
    capacity_rps: float
    results: tuple[Result, ...]  # in the order of POLICIES

    def result(self, policy: Policy) -> Result:
        return self.results[POLICIES.index(policy)]


class Fleet:
    """Schedule and its workers for one run: events on a heap, ms on a logical clock."""

    def __init__(self, workload: sim.Workload, config: FleetConfig, policy: Policy,
                 rng: random.Random) -> None:
        self.workload, self.config, self.policy, self.rng = workload, config, policy, rng
        self.ids = [f"w{i:04d}" for i in range(config.workers)]  # choose's ties: lower id
        self.position = {wid: i for i, wid in enumerate(self.ids)}
        spec, model = config.spec, config.model
        self.workers = [sim.Worker(spec, model, config.segment_steps) for _ in self.ids]
        self.capacity = config.spec.max_seqs
        self.busy = [0] * config.workers
        self.loads = [WorkerLoad(wid, 0, self.capacity) for wid in self.ids]
        self.index = PrefixIndex(config.index_blocks, config.index_ttl_s)
        self.route = RoutePolicy(prefix_aware=policy == "prefix-aware")
        self.queue: deque[sim.Job] = deque()
        self.events: list[tuple[float, int, sim.Job | tuple[int, int]]] = []
        self._segment = [0] * config.workers  # the live segment of each worker
        self._order = itertools.count()
        self._kicks: set[int] = set()
        self.arrived = self.refused = 0
        self.first_arrival, self.last_arrival = math.inf, 0.0
        self.answered: list[sim.Job] = []
        self.max_load_ratio = 0.0

    def push(self, at_ms: float, item: sim.Job | tuple[int, int]) -> None:
        heappush(self.events, (at_ms, next(self._order), item))

    def run(self) -> None:
        while self.events:
            now, _, item = heappop(self.events)
            if isinstance(item, sim.Job):
                self.arrive(item, now)
            elif item[1] == self._segment[item[0]]:  # else a segment since cut short
                self.segment_ended(item[0], now)
            for i in sorted(self._kicks):
                worker = self.workers[i]
                end = worker.cut(now) if worker.stepping else worker.start(now)
                if end is not None:
                    self._segment[i] += 1
                    self.push(end, (i, self._segment[i]))
            self._kicks.clear()

    def arrive(self, job: sim.Job, now: float) -> None:
        """As schedule's ``handle``: placed at once when nothing waits and a worker
        has room; else parked behind the others, unless the queue is full."""
        self.arrived += 1
        self.first_arrival = min(self.first_arrival, now)
        self.last_arrival = now
        self.expire(now)
        if not self.queue:
            if not self.place(job, now):
                self.queue.append(job)
        elif len(self.queue) >= self.config.queue_max:
            self.refused += 1
        else:
            self.queue.append(job)

    def expire(self, now: float) -> None:
        """Refuse the parked requests that waited too long (the oldest are first)."""
        limit_ms = self.config.schedule_timeout_s * 1000
        while self.queue and now - self.queue[0].arrival_ms > limit_ms:
            self.queue.popleft()
            self.refused += 1

    def segment_ended(self, i: int, now: float) -> None:
        for job in self.workers[i].end(now):
            self.busy[i] -= 1
            self.loads[i] = WorkerLoad(self.ids[i], self.busy[i], self.capacity)
            self.answered.append(job)
            session = self.workload.sessions[job.session]
            if job.index + 1 < len(session):
                at = now + job.turn.think_ms
                self.push(at, sim.Job(session[job.index + 1], job.session, job.index + 1, at))
        self.expire(now)
        while self.queue and self.place(self.queue[0], now):
            self.queue.popleft()
        self._kicks.add(i)

    def place(self, job: sim.Job, now: float) -> bool:
        """Send ``job`` to the worker the policy picks among those with room."""
        roomy = [i for i, busy in enumerate(self.busy) if busy < self.capacity]
        if not roomy:
            return False
        blocks = job.turn.prompt_blocks[:sim.SCHEDULE_BLOCKS]
        if self.policy == "random":
            i = self.rng.choice(roomy)
        else:
            chosen = choose([self.loads[i] for i in roomy], blocks, self.index, self.route,
                            int(now))
            assert chosen is not None
            i = self.position[chosen.worker_id]
        self._note_load(roomy, i)
        self.index.took(self.ids[i], blocks, int(now))
        self.busy[i] += 1
        self.loads[i] = WorkerLoad(self.ids[i], self.busy[i], self.capacity)
        self.workers[i].waiting.append(job)
        self._kicks.add(i)
        return True

    def _note_load(self, roomy: list[int], i: int) -> None:
        """The chosen worker's load over choose's bound for it (workers/prefix.py's
        ``load_limit``)."""
        total = sum(self.busy[j] for j in roomy) + 1
        capacity = sum(self.loads[j].weight() for j in roomy)
        bound = load_limit(self.loads[i], total, capacity, self.route)
        self.max_load_ratio = max(self.max_load_ratio, (self.busy[i] + 1) / bound)

    def result(self) -> Result:
        done = self.answered
        prompt = sum(j.turn.prompt_tokens for j in done)
        ttfts = [j.first_ms - j.arrival_ms for j in done]
        span_ms = max((j.done_ms for j in done), default=0.0) - self.first_arrival
        arrivals_ms = self.last_arrival - self.first_arrival
        output = sum(j.turn.output_tokens for j in done)
        return Result(
            policy=self.policy, arrived=self.arrived, answered=len(done), refused=self.refused,
            offered_rps=(self.arrived - 1) / arrivals_ms * 1000 if arrivals_ms > 0 else math.nan,
            cache_hit=sum(j.cached_tokens for j in done) / prompt if prompt else math.nan,
            ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99),
            tokens_per_s=output / span_ms * 1000 if span_ms > 0 else math.nan,
            max_load_ratio=self.max_load_ratio)


def simulate(workload: sim.Workload, config: FleetConfig, policy: Policy, rate_rps: float,
             seed: int = 1) -> Result:
    """One run: ``workload``'s sessions starting as a Poisson process (requests at
    ``rate_rps``; conversations at ``rate_rps`` / their turns), the same arrivals
    whatever the policy."""
    tag = f"{seed}/{workload.name}/{config.workers}/{rate_rps!r}"
    fleet = Fleet(workload, config, policy, random.Random(f"{tag}/random-policy"))
    arrivals = random.Random(f"{tag}/arrivals")
    per_ms = rate_rps / fmean(len(s) for s in workload.sessions) / 1000
    at = 0.0
    for s, session in enumerate(workload.sessions):
        at += arrivals.expovariate(per_ms)
        fleet.push(at, sim.Job(session[0], s, 0, at))
    fleet.run()
    return fleet.result()


def run_cell(workload: sim.Workload, config: FleetConfig, load: float, seed: int) -> Cell:
    capacity = config.workers * sim.worker_rate(workload, config.spec, config.model)
    results = tuple(simulate(workload, config, p, load * capacity, seed) for p in POLICIES)
    return Cell(workload.name, config.workers, load, load * capacity, capacity, results)


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 and not math.isnan(num) else math.nan


def table(cells: Sequence[Cell]) -> str:
    rows = []
    for cell in cells:
        ll, pa = cell.result("least-loaded"), cell.result("prefix-aware")
        for r in cell.results:
            rows.append([
                f"{cell.load:g}", fmt(cell.rate_rps), fmt(r.offered_rps), r.policy,
                fmt(100 * r.cache_hit),
                fmt(r.ttft_p50_ms), fmt(r.ttft_p99_ms), fmt(r.tokens_per_s, 0),
                fmt(100 * r.refused_share, 2), fmt(r.max_load_ratio, 2),
                fmt(ratio(ll.ttft_p50_ms, pa.ttft_p50_ms), 2) if r is pa else ""])
    return markdown_table(["load", "req/s", "sent/s", "policy", "hit %", "TTFT p50 ms",
                           "TTFT p99 ms", "out tok/s", "refused %", "load/bound", "LL/PA p50"],
                          rows)


def checks(cells: Sequence[Cell]) -> list[str]:
    """Prefix-aware against least-loaded over the rates of one workload and fleet."""
    scenario = f"{cells[0].workload}, {cells[0].workers} workers"
    p50s = sorted((ratio(c.result("least-loaded").ttft_p50_ms,
                         c.result("prefix-aware").ttft_p50_ms), c.load) for c in cells)
    p99, at = max((ratio(c.result("prefix-aware").ttft_p99_ms,
                         c.result("least-loaded").ttft_p99_ms), c.load) for c in cells)
    refused, who, when = max(((100 * r.refused_share, r.policy, c.load) for c in cells
                              if c.load < 1.0 for r in c.results), default=(0.0, "-", 0.0))
    bound = max(c.result("prefix-aware").max_load_ratio for c in cells)
    found = [Check(scenario, f"least-loaded TTFT p50 / prefix-aware's, {how} (load {load:g})",
                   value, 3.0, ">=", "x")
             for how, (value, load) in (("lowest", p50s[0]), ("highest", p50s[-1]))] + [
        Check(scenario, f"prefix-aware TTFT p99, % of least-loaded's, highest (load {at:g})",
              100 * p99, 100.0, "<=", "%"),
        Check(scenario, "refused below load 1.0, most of any policy"
              + (f" ({who}, load {when:g})" if refused else ""), refused, 0.0, "<=", "%"),
        Check(scenario, "prefix-aware load / load bound, highest", bound, 1.0, "<=", "x"),
    ]
    return [f"{scenario}: {c.line()}" for c in found]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _coefficients(text: str) -> tuple[float, float, float]:
    a, b, c = _floats(text)  # three, or argparse says the value is invalid
    return a, b, c


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--quick", action="store_true", help="1000 requests a cell, 8 workers")
    add("--workloads", default="shared-prefix,chat")
    add("--workers", default="8,32,128", help="fleet sizes")
    add("--rates", default="0.25,0.5,0.75,0.9,1.0,1.2",
        help="fractions of the fleet's estimated capacity")
    add("--requests", type=int, default=10_000, help="at least this many a cell")
    add("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes running cells")
    spec = sim.WorkerSpec()
    for flag, default in [("--seed", 1), ("--max-seqs", spec.max_seqs),
                          ("--kv-tokens", spec.kv_tokens),
                          ("--prefill-budget", spec.prefill_budget),
                          ("--host-tokens", spec.host_tokens), ("--queue-max", 256)]:
        add(flag, type=int, default=default)
    add("--scale", type=float, default=1.0, help="every step time multiplied by this")
    add("--prefill-ms", type=_coefficients, default=sim.StepModel().prefill,
        help="A,B,C: A T^2 + B T + C")
    add("--decode-ms", type=_coefficients, default=sim.StepModel().decode,
        help="A,B,C: A p^2 + B p + C")
    add("--schedule-timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.workers = 1000, "8"
    return args


def workloads(args: argparse.Namespace) -> list[sim.Workload]:
    """The workloads named, in their default shapes (:mod:`bench.fleet_sim_model`)."""
    makers = {"shared-prefix": sim.shared_prefix, "chat": sim.chat}
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"bench.fleet_sim: no workload {unknown[0]!r} (shared-prefix, chat)")
    return [makers[n](args.requests, seed=args.seed) for n in names]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    spec = sim.WorkerSpec(args.max_seqs, args.kv_tokens, args.prefill_budget, args.host_tokens)
    model = sim.StepModel(args.prefill_ms, args.decode_ms, args.scale)
    started = time.perf_counter()
    loads = _floats(args.rates)
    sizes = [int(n) for n in _floats(args.workers)]
    plays = workloads(args)
    print(f"workers: {asdict(spec)}; step model: {asdict(model)}; schedule timeout "
          f"{args.schedule_timeout_s:g} s, queue max {args.queue_max}; seed {args.seed}")
    for w in plays:
        print(f"workload {w.name}: {w.params}")
    tasks = [(w, FleetConfig(n, spec, model, args.schedule_timeout_s, args.queue_max), load,
              args.seed) for w in plays for n in sizes for load in loads]
    cells: list[Cell] = []
    lines: list[str] = []
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for cell in pool.map(run_cell, *zip(*tasks, strict=True)):
            cells.append(cell)
            if len(cells) % len(loads) == 0:  # a workload and fleet size done
                block = cells[-len(loads):]
                print(f"\n{cell.workload}, {cell.workers} workers (estimated capacity "
                      f"{cell.capacity_rps:.1f} req/s)\n{table(block)}", flush=True)
                lines.extend(checks(block))
    print("\n" + "\n".join(lines))
    print(f"\n{len(cells) * len(POLICIES)} runs in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
