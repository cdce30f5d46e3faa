"""What Conveyor's pipeline adds over calling an engine directly: the same
streamed completions sent to the upstream fixture and through ``conveyor up
--engine openai`` in front of it, side by side (:mod:`bench.compare`), at
concurrency 1 (paced), and at ``--concurrency`` paced and unpaced (the
pipeline's own limit). Targets: docs/decisions/0013-the-price-of-the-log.md.

    python -m bench.overhead [--quick] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio

from bench import compare
from bench.compare import Result, Scenario, report_summary, sides
from bench.harness import DELAY_MS, TOKENS, Pipeline, as_script, loop_factory, pipeline
from bench.stats import Check, percentile

__all__ = ["main", "scenarios"]


def scenarios(quick: bool, n: int = 32) -> list[Scenario]:
    """c=1 paced, then ``n`` streams paced and unpaced; ``quick`` about 5x less."""
    paced = f"{TOKENS} tokens x {DELAY_MS} ms"
    requests, window, rounds = (200, 2.0, 2) if quick else (1000, 10.0, 4)
    return [
        Scenario("c1-paced", f"concurrency 1, {paced}", 1, True, *(
            (4, 40, 30.0) if quick else (20, 200, 120.0))),
        Scenario(f"c{n}-paced", f"concurrency {n}, {paced}", n, True, 1,
                 max(requests, 2 * n * rounds), window, rounds),
        Scenario(f"c{n}-unpaced", f"concurrency {n}, {TOKENS} tokens unpaced", n, False, 1,
                 max(requests, 2 * n * rounds), window, rounds),
    ]


def checks(result: Result) -> list[Check]:
    """The pipeline's targets against the direct calls of the same run: a gateway
    in front of fast models must not be the bottleneck, nor make the first token
    late."""
    added = result.added_ttft()
    sc = result.scenario
    if sc.concurrency == 1:
        return [Check(sc.key, "added TTFT p50", percentile(added, 50) * 1000, 5, "<=", "ms"),
                Check(sc.key, "added TTFT p99", percentile(added, 99) * 1000, 15, "<=", "ms")]
    if sc.paced:
        # N streams x 320 ms in theory: keep up with the direct side
        return [Check(sc.key, "Conveyor rate (>= 98% of direct)", result.variant.rate,
                      round(0.98 * result.base.rate, 1), ">=", "req/s"),
                Check(sc.key, "added TTFT p50", percentile(added, 50) * 1000, 10, "<=", "ms")]
    return [Check(sc.key, "Conveyor streamed rate", result.variant.rate, 1000, ">=", "req/s")]


async def measure(plan: list[Scenario], stage: Pipeline, connections: int) -> list[Result]:
    async with sides(stage, connections) as (direct, conveyor):
        return await compare.measure(plan, direct, conveyor, checks)


def run(args: argparse.Namespace) -> list[Result]:
    with pipeline(args.upstream_port, args.gateway_port) as stage, \
            asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(measure(scenarios(args.quick, args.concurrency), stage,
                                  args.concurrency + 8))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description="Latency and throughput Conveyor adds over calling the upstream directly.")
    parser.add_argument("--quick", action="store_true", help="about 5x fewer requests")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="streams at once in the concurrent scenarios")
    parser.add_argument("--upstream-port", type=int, default=9100)
    parser.add_argument("--gateway-port", type=int, default=8100)
    args = parser.parse_args(argv)
    if args.concurrency < 2:
        parser.error("--concurrency is 2 or more")
    with as_script("bench.overhead"):
        results = run(args)
    print()
    report_summary(results, "Overhead: Conveyor vs. the upstream called directly", checks)


if __name__ == "__main__":
    main()
