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
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.client import make_client
from bench.harness import (
    BenchError,
    check_infra,
    check_port_free,
    conveyor_env,
    conveyor_script,
    exit_on_sigterm,
    running,
    wait_http,
)
from bench.scenarios import (
    DELAY_MS,
    TOKENS,
    Result,
    Scenario,
    Side,
    Tally,
    run_rounds,
    run_serial,
    scenarios,
)
from bench.stats import Check, markdown_table, ms, percentile

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


async def first_success(side: Side, timeout_s: float) -> None:
    """Conveyor's first request can fail while its consumers join their groups."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while time.monotonic() < deadline:
        sample = await side.one(paced=False)
        if sample.ok:
            return
        last = sample.error or ""
        await asyncio.sleep(0.5)
    raise BenchError(f"{side.name}: no successful request within {timeout_s:.0f} s: {last}")


async def measure(plan: list[Scenario], upstream_url: str, gateway_url: str) -> list[Result]:
    results: list[Result] = []
    async with make_client() as direct_client, make_client() as conveyor_client:
        direct = Side(
            "direct",
            f"{upstream_url}/v1/completions",
            {True: f"bench@{DELAY_MS}", False: "bench@0"},
            direct_client,
        )
        conveyor = Side(
            "conveyor",
            f"{gateway_url}/v1/completions",
            {True: "bench-paced", False: "bench-unpaced"},
            conveyor_client,
        )
        await first_success(direct, 30.0)
        await first_success(conveyor, 90.0)
        for sc in plan:
            runner: Callable[[Scenario, Side, Side], Coroutine[Any, Any, Result]]
            runner = run_serial if sc.concurrency == 1 else run_rounds
            print(f"running {sc.key}: {sc.title} ...", flush=True)
            try:
                result = await asyncio.wait_for(runner(sc, direct, conveyor), sc.hard_limit_s)
            except TimeoutError as exc:
                raise BenchError(f"{sc.key} ran past {sc.hard_limit_s:.0f} s") from exc
            report_scenario(result)
            results.append(result)
    return results


# Reporting


def _side_row(sc: Scenario, name: str, tally: Tally) -> list[str]:
    ttft = [s.ttft for s in tally.ok]
    total = [s.total for s in tally.ok]
    return [
        sc.key,
        name,
        f"{len(tally.ok)}" + (f" (+{len(tally.failed)} failed)" if tally.failed else ""),
        ms(percentile(ttft, 50)),
        ms(percentile(ttft, 99)),
        ms(percentile(total, 50)),
        ms(percentile(total, 99)),
        "-" if math.isnan(tally.rate) else f"{tally.rate:.1f}",
    ]


HEADER = ["scenario", "side", "requests", "TTFT p50 ms", "TTFT p99 ms"]
HEADER += ["total p50 ms", "total p99 ms", "req/s"]


def report_scenario(result: Result) -> None:
    sc = result.scenario
    print(f"\n== {sc.key}: {sc.title} ==")
    rows = [_side_row(sc, "direct", result.direct), _side_row(sc, "conveyor", result.conveyor)]
    print(markdown_table(HEADER, rows))
    added = result.added_ttft()
    print(
        f"added TTFT (conveyor - direct, {len(added)} pairs): "
        f"p50 {ms(percentile(added, 50))} ms, p99 {ms(percentile(added, 99))} ms"
    )
    for tally, name in ((result.direct, "direct"), (result.conveyor, "conveyor")):
        short = [s for s in tally.ok if s.chars != TOKENS * len(" tok")]
        if short:
            print(
                f"warning: {len(short)} {name} streams had {short[0].chars} characters, "
                f"not {TOKENS * len(' tok')}"
            )
        if tally.failed:
            print(f"{name}: {len(tally.failed)} failed, first: {tally.failed[0].error}")
    for check in result.checks():
        print(check.line())
    print(flush=True)


def report_summary(results: list[Result]) -> None:
    rows: list[list[str]] = []
    checks: list[Check] = []
    for result in results:
        sc = result.scenario
        rows.append(_side_row(sc, "direct", result.direct))
        rows.append(_side_row(sc, "conveyor", result.conveyor))
        added = result.added_ttft()
        p50, p99 = ms(percentile(added, 50)), ms(percentile(added, 99))
        rows.append([sc.key, "added (paired)", str(len(added)), p50, p99, "", "", ""])
        checks.extend(result.checks())
    print("## Overhead: Conveyor vs. the upstream called directly\n")
    print(markdown_table(HEADER, rows))
    print()
    print(
        markdown_table(
            ["scenario", "figure", "measured", "target", "met"],
            [
                [c.scenario, c.label, c.measured(), c.target(), "yes" if c.met else "no"]
                for c in checks
            ],
        )
    )


# Processes


def run(quick: bool, upstream_port: int, gateway_port: int) -> list[Result]:
    check_infra()
    check_port_free(upstream_port, "upstream")
    check_port_free(gateway_port, "gateway")
    script = conveyor_script()
    work = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    print(f"logs and registry in {work}", flush=True)
    models = work / "models.toml"
    models.write_text(REGISTRY)
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    env = conveyor_env(
        topic_prefix=f"bench{int(time.time())}", gateway_port=gateway_port, models_file=models
    )
    upstream_argv = [sys.executable, "-m", "bench.upstream", "--port", str(upstream_port)]
    upstream_argv += ["--tokens", str(TOKENS), "--delay-ms", str(DELAY_MS)]
    conveyor_argv = [str(script), "up", "--engine", "openai", "--upstream", upstream_url]
    conveyor_argv += ["--pool", "bench", "--capacity", "64", "--no-infra"]
    with ExitStack() as stack:
        upstream = stack.enter_context(running("upstream", upstream_argv, work))
        wait_http(f"{upstream_url}/v1/models", upstream, 30.0)
        conveyor = stack.enter_context(running("conveyor", conveyor_argv, work, env))
        wait_http(f"{gateway_url}/healthz", conveyor, 180.0)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(measure(scenarios(quick), upstream_url, gateway_url))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description="Latency and throughput Conveyor adds over calling the upstream directly.",
    )
    parser.add_argument("--quick", action="store_true", help="about 5x fewer requests")
    parser.add_argument("--upstream-port", type=int, default=9100)
    parser.add_argument("--gateway-port", type=int, default=8100)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    try:
        results = run(args.quick, args.upstream_port, args.gateway_port)
    except BenchError as exc:
        print(f"bench.overhead: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    print()
    report_summary(results)


if __name__ == "__main__":
    main()
