"""What Conveyor's pipeline adds over calling an engine directly.

Starts the upstream fixture (``bench.upstream``) and ``conveyor up --engine
openai`` in front of it, then sends the same streaming completion requests
directly to the upstream and through Conveyor, alternating so both sides see
the same machine state:

- ``c1-paced``: concurrency 1, direct and Conveyor requests in alternating pairs;
- ``c32-paced``: concurrency 32, alternating rounds of 32 concurrent streams;
- ``c32-unpaced``: the same with an unpaced upstream (pure pipeline cost).

Pacing travels in the model name (``bench@10``, ``bench@0``), so one upstream
and one Conveyor serve every scenario: the registry maps ``bench-paced`` and
``bench-unpaced`` onto those upstream names.

    python -m bench.overhead [--quick]
    python -m bench.overhead --soak 100000    # a long run, RSS sampled (bench/soak.py)
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench import compare
from bench.client import make_client
from bench.compare import Comparison, loop_factory, report_main, staged
from bench.harness import (
    conveyor_env,
    running,
    wait_http,
)
from bench.scenarios import DELAY_MS, Result, Scenario, Side, scenarios
from bench.soak import run_soak
from bench.stats import Check, percentile

__all__ = ["main"]

REGISTRY = f"""\
[models."bench-upstream"]
pool = "bench"
context_length = 8192
default_max_tokens = 64
tokenizer = "estimate"
upstream_model = "bench"

[models."bench-paced"]
pool = "bench"
context_length = 8192
default_max_tokens = 64
tokenizer = "estimate"
upstream_model = "bench@{DELAY_MS}"

[models."bench-unpaced"]
pool = "bench"
context_length = 8192
default_max_tokens = 64
tokenizer = "estimate"
upstream_model = "bench@0"
"""


def checks(result: Result) -> list[Check]:
    """The pipeline's targets against the direct calls of the same run (those of
    "The price of the log": a gateway in front of fast models must not be the
    bottleneck, nor make the first token late)."""
    added = result.added_ttft()
    key = result.scenario.key
    if key == "c1-paced":
        return [Check(key, "added TTFT p50", percentile(added, 50) * 1000, 5, "<=", "ms"),
                Check(key, "added TTFT p99", percentile(added, 99) * 1000, 15, "<=", "ms")]
    if key == "c32-paced":
        # ~99 req/s in theory (32 streams x 320 ms): keep up with the direct side
        return [Check(key, "Conveyor rate (~99 ideal, >= 98% of direct)", result.variant.rate,
                      round(0.98 * result.base.rate, 1), ">=", "req/s"),
                Check(key, "added TTFT p50", percentile(added, 50) * 1000, 10, "<=", "ms")]
    # (sustained over 100,000 requests: --soak 100000)
    return [Check(key, "Conveyor streamed rate", result.variant.rate, 1000, ">=", "req/s")]


OVERHEAD = Comparison("direct", "conveyor", "Overhead: Conveyor vs. the upstream called directly",
                      checks)


async def measure(plan: list[Scenario], upstream_url: str, gateway_url: str) -> list[Result]:
    async with make_client() as direct_client, make_client() as conveyor_client:
        direct = Side("direct", f"{upstream_url}/v1/completions",
                      {True: f"bench@{DELAY_MS}", False: "bench@0"}, direct_client)
        conveyor = Side("conveyor", f"{gateway_url}/v1/completions",
                        {True: "bench-paced", False: "bench-unpaced"}, conveyor_client)
        return await compare.measure(plan, direct, conveyor, OVERHEAD)


# Processes


def run(quick: bool, upstream_port: int, gateway_port: int,
        soak: tuple[int, int, float] | None = None) -> list[Result]:
    """The scenarios; with ``soak`` (requests, concurrency, sample seconds) a
    long Conveyor-only run instead (bench/soak.py), printed, no scenarios."""
    with staged(upstream_port, {gateway_port: "gateway"}, REGISTRY) as (stage, stack):
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        env = conveyor_env(topic_prefix=f"bench{int(time.time())}", gateway_port=gateway_port,
                           models_file=stage.models)
        conveyor_argv = [str(stage.script), "up", "--engine", "openai", "--upstream",
                         stage.upstream_url, "--pool", "bench", "--capacity", "64", "--no-infra"]
        conveyor = stack.enter_context(running("conveyor", conveyor_argv, stage.work, env))
        wait_http(f"{gateway_url}/healthz", conveyor, 180.0)
        if soak is not None:
            run_soak(gateway_url, conveyor.popen.pid, *soak).report()
            return []
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(measure(scenarios(quick), stage.upstream_url, gateway_url))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description="Latency and throughput Conveyor adds over calling the upstream directly.",
    )
    parser.add_argument("--quick", action="store_true", help="about 5x fewer requests")
    parser.add_argument("--upstream-port", type=int, default=9100)
    parser.add_argument("--gateway-port", type=int, default=8100)
    parser.add_argument("--soak", type=int, metavar="N",
                        help="instead: N unpaced streams through Conveyor, RSS sampled")
    parser.add_argument("--concurrency", type=int, default=32, help="of --soak")
    parser.add_argument("--sample-s", type=float, default=10.0, help="of --soak")
    args = parser.parse_args(argv)
    if args.soak:
        run(args.quick, args.upstream_port, args.gateway_port,
            (args.soak, args.concurrency, args.sample_s))
        return
    report_main("bench.overhead", OVERHEAD, lambda: run(
        args.quick, args.upstream_port, args.gateway_port))

if __name__ == "__main__":
    main()
