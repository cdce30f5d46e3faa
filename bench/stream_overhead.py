"""What resumable streams and metrics cost on Conveyor's hot path.

Two whole pipelines (``conveyor layer``, ``conveyor infer --engine openai``,
``conveyor gateway``, each on its own topic prefix) serve the same upstream
fixture:

- ``plain``: ``CONVEYOR_RESUMABLE_STREAMS=false`` and
  ``CONVEYOR_METRICS_ENABLED=false``: SSE events carry no ids, a dropped
  client's generation is cancelled at once, no process records a metric;
- ``full``: the defaults (every SSE event has its ``id:``, a drop waits
  ``resume_grace_s``), metrics recorded by the gateway (``/metrics``), the
  layers and the infer worker (each on a metrics port), and all three scraped
  every :data:`SCRAPE_S` seconds as Prometheus would, only more often.

Both pipelines run all the time; requests alternate between them
(``bench.compare``), so both see the same machine. Targets (the issue of
record): resumable streams and metrics add at most 1 ms to TTFT p50 at
concurrency 1 and cost at most 5 % of the unpaced c=32 rate.

Before measuring, each side is checked to be what it claims: ``full``
streams carry ids and its counters move, ``plain`` streams have no ids and
its gateway has no ``/metrics``.

    python -m bench.stream_overhead [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from contextlib import ExitStack

import httpx

from bench import compare
from bench.client import make_client
from bench.compare import (
    Comparison,
    FineCheck,
    Stage,
    loop_factory,
    plan,
    report_main,
    staged,
)
from bench.harness import (
    BenchError,
    Proc,
    conveyor_env,
    running,
    wait_http,
)
from bench.scenarios import PROMPT, TOKENS, Result, Scenario, Side
from bench.stats import Check, percentile

__all__ = ["main"]

TTFT_TARGET_MS = 1.0
RATE_TARGET = 0.95
SCRAPE_S = 5.0
REQUESTS_COUNTER = "conveyor_gateway_requests_total"


# -- targets -----------------------------------------------------------------------


def checks(result: Result) -> list[Check]:
    key = result.scenario.key
    if key == "c1-paced":
        added = percentile(result.added_ttft(), 50) * 1000
        return [FineCheck(key, "added TTFT p50 (full - plain, paired)", added, TTFT_TARGET_MS,
                          "<=", "ms")]
    plain_rate, full_rate = result.base.rate, result.variant.rate
    return [Check(key, f"full rate (>= {RATE_TARGET:.0%} of plain's {plain_rate:.1f})",
                  full_rate, round(RATE_TARGET * plain_rate, 1), ">=", "req/s")]


STREAMS = Comparison("plain", "full", "Resumable streams and metrics: defaults vs. both off",
                     checks, fine=True)


# -- what each side is -------------------------------------------------------------


async def _requests_counted(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(REQUESTS_COUNTER + "{"))


async def _stream_ids(client: httpx.AsyncClient, gateway: str) -> int:
    """How many ``id:`` lines one streamed completion carries."""
    body = {"model": "bench-unpaced", "prompt": PROMPT, "max_tokens": TOKENS, "stream": True}
    async with client.stream("POST", f"{gateway}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise BenchError(f"{gateway} answered {r.status_code}: {(await r.aread())[:200]!r}")
        return sum([line.startswith("id: ") async for line in r.aiter_lines()])


async def check_sides(plain: str, full: str, scraped: list[str], resumable: bool) -> None:
    """``full`` streams carry ids when ``resumable`` and its request counter moves
    when it has metrics (``scraped``); ``plain`` streams carry none and it serves
    no /metrics."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        before = await _requests_counted(client, f"{full}/metrics") if scraped else 0.0
        full_ids = await _stream_ids(client, full)
        await asyncio.sleep(0.2)  # the counter is written as the answer closes
        after = await _requests_counted(client, f"{full}/metrics") if scraped else 0.0
        plain_ids = await _stream_ids(client, plain)
        plain_metrics = (await client.get(f"{plain}/metrics")).status_code
        for url in scraped:
            if (await client.get(url)).status_code != 200:
                raise BenchError(f"{url} does not answer")
    if bool(full_ids) != resumable or (scraped and after <= before):
        raise BenchError(f"the full side is not what it should be: {full_ids} ids, "
                         f"requests counted {before} -> {after}")
    if plain_ids or plain_metrics != 404:
        raise BenchError(f"the plain side is not plain: {plain_ids} ids, /metrics "
                         f"{plain_metrics}")
    print(f"full: {full_ids} event ids a stream, {REQUESTS_COUNTER} {before:g} -> {after:g}; "
          f"plain: no ids, /metrics {plain_metrics}", flush=True)


async def _scrape(urls: list[str]) -> None:
    """Read every metrics endpoint every :data:`SCRAPE_S` seconds, as Prometheus does."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        while True:
            for url in urls:
                with contextlib.suppress(httpx.HTTPError):
                    await client.get(url)
            await asyncio.sleep(SCRAPE_S)


async def measure(scenarios: list[Scenario], plain_url: str, full_url: str,
                  scraped: list[str], resumable: bool) -> list[Result]:
    async with make_client() as plain_client, make_client() as full_client:
        models = {True: "bench-paced", False: "bench-unpaced"}
        plain = Side("plain", f"{plain_url}/v1/completions", models, plain_client)
        full = Side("full", f"{full_url}/v1/completions", models, full_client)
        await compare.first_success(plain, 90.0)
        await compare.first_success(full, 90.0)
        await check_sides(plain_url, full_url, scraped, resumable)
        scraper = asyncio.create_task(_scrape(scraped))
        try:
            return await compare.measure(scenarios, plain, full, STREAMS)
        finally:
            scraper.cancel()


# -- processes ---------------------------------------------------------------------


def _pipeline(stack: ExitStack, name: str, env: dict[str, str], stage: Stage,
              metrics_ports: tuple[int, int] | None) -> Proc:
    """One side's layers, infer worker and gateway; the gateway's process."""
    def on(i: int) -> list[str]:
        return ["--metrics-port", str(metrics_ports[i])] if metrics_ports else []

    script, work = str(stage.script), stage.work
    infer = ["infer", "--engine", "openai", "--upstream", stage.upstream_url, "--pool", "bench",
             "--capacity", "64", "--worker-id", f"{name}-0"]
    stack.enter_context(running(f"{name}-layers", [script, *on(0), "layer"], work, env))
    stack.enter_context(running(f"{name}-infer", [script, *on(1), *infer], work, env))
    return stack.enter_context(running(f"{name}-gateway", [script, "gateway"], work, env))


def run(quick: bool, upstream_port: int, plain_port: int, full_port: int,
        metrics_ports: tuple[int, int], variant: str = "both") -> list[Result]:
    ports = {plain_port: "gateway (plain)", full_port: "gateway (full)",
             metrics_ports[0]: "layers metrics", metrics_ports[1]: "infer metrics"}
    with staged(upstream_port, ports) as (stage, stack):
        stamp = int(time.time())
        plain_url, full_url = f"http://127.0.0.1:{plain_port}", f"http://127.0.0.1:{full_port}"
        plain_env = conveyor_env(topic_prefix=f"benchplain{stamp}", gateway_port=plain_port,
                                 models_file=stage.models)
        plain_env.update(CONVEYOR_RESUMABLE_STREAMS="false", CONVEYOR_METRICS_ENABLED="false")
        full_env = conveyor_env(topic_prefix=f"benchfull{stamp}", gateway_port=full_port,
                                models_file=stage.models)
        for env in (plain_env, full_env):
            env["CONVEYOR_AUTH"] = "none"
        full_env.update(CONVEYOR_RESUMABLE_STREAMS=str(variant != "metrics").lower(),
                        CONVEYOR_METRICS_ENABLED=str(variant != "resume").lower())
        scraped = [] if variant == "resume" else [f"{full_url}/metrics"] + [
            f"http://127.0.0.1:{p}/metrics" for p in metrics_ports]
        plain_gw = _pipeline(stack, "plain", plain_env, stage, None)
        full_gw = _pipeline(stack, "full", full_env, stage, metrics_ports)
        wait_http(f"{plain_url}/healthz", plain_gw, 180.0)
        wait_http(f"{full_url}/healthz", full_gw, 180.0)
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(measure(plan(quick), plain_url, full_url, scraped,
                                      resumable=variant != "metrics"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stream_overhead",
        description="What resumable streams and metrics add over both turned off.")
    parser.add_argument("--quick", action="store_true", help="about 5x fewer requests")
    parser.add_argument("--upstream-port", type=int, default=9130)
    parser.add_argument("--plain-port", type=int, default=8130,
                        help="the gateway with resumable streams and metrics off")
    parser.add_argument("--full-port", type=int, default=8131,
                        help="the gateway with both on (the defaults)")
    parser.add_argument("--metrics-ports", type=int, nargs=2, default=(9131, 9132),
                        metavar=("LAYERS", "INFER"), help="the full side's metrics ports")
    parser.add_argument("--only", choices=["resume", "metrics"], default=None,
                        help="turn only this one on on the full side, to see which costs")
    args = parser.parse_args(argv)
    report_main("bench.stream_overhead", STREAMS, lambda: run(
        args.quick, args.upstream_port, args.plain_port, args.full_port,
        tuple(args.metrics_ports), args.only or "both"))

if __name__ == "__main__":
    main()
