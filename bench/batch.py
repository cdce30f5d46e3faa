"""Batch work beside interactive traffic on the same workers.

Starts the upstream fixture, ``conveyor layer``, two workers ``conveyor infer
--engine openai --capacity 8`` and ``conveyor gateway`` (a fresh topic prefix,
their own files folder) and measures, in one run:

1. **batch alone**: B lines (500; ``--quick`` 100) through the OpenAI Batch
   API, nothing else running, from ``create`` to ``completed`` seen. A line
   is 32 tokens at 20 ms (the pacing is in the model name), so it holds a
   slot 640 ms and the workers' capacity is ``2 x 8 / 0.64 s = 25 lines/s``;
2. **interactive alone**: the same completions streamed at concurrency 4;
3. **interactive + batch**: the same beside a second batch of B lines, once a
   wave of it has completed, until fewer lines are left than twice its cap.

Targets (the issue of record): TTFT p50 beside the batch within 15 % of the
figure without it; the batch alone at least 90 % of the workers' capacity.

Decisions: 16 slots, because ``batch_max_share`` 0.75 then leaves 4 free
while interactive traffic is around, the interactive concurrency (a smaller
pool makes interactive requests wait by design). 20 ms a token (a GPU's
50 tokens/s a stream) makes the batch run 20 s, so its fixed costs weigh as
on a real batch. Interactive alone runs half before the second batch and
half after it (A B A): a batch cannot be paused, so rounds cannot alternate
more finely. A consumer of the pool's task topic, ``conveyor.tokens`` and
``conveyor.replies`` shows what the log knows: generations in flight (task
sent, final chunk not yet written; batch ones by their ``batch_`` request
ids) and each interactive request's per-layer stamps; ``/proc`` shows the CPU
each process (the shared broker too) used in each scenario. Those explain a
missed target without a second run.

    python -m bench.batch [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import openai

from bench.batch_log import CAPACITY, POOL, WORKERS, CpuMeter, InFlight, cpu_since
from bench.batch_report import CONCURRENCY, SLOTS, BatchRun, Figures, Interactive, report
from bench.client import make_client
from bench.compare import first_success
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
from bench.scenarios import PROMPT, TOKENS, Side
from conveyor.settings import Settings

__all__ = ["main"]

POLL_S = 0.2


@dataclass(frozen=True)
class Plan:
    lines: int  # in each batch
    alone: int  # interactive requests in each half of the alone scenario
    beside: int  # interactive requests beside the batch, at most


def registry(delay_ms: int) -> str:
    return "\n".join(
        f'[models."{name}"]\npool = "{POOL}"\ncontext_length = 8192\ndefault_max_tokens = 64\n'
        f'tokenizer = "estimate"\nupstream_model = "{upstream}"\n'
        for name, upstream in (("bench-paced", f"bench@{delay_ms}"), ("bench-unpaced", "bench@0")))


async def start_batch(api: openai.AsyncOpenAI, lines: int) -> BatchRun:
    body = {"model": "bench-paced", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    data = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                               "url": "/v1/completions", "body": body}) + "\n"
                   for i in range(lines))
    upload = await api.files.create(file=("batch.jsonl", io.BytesIO(data.encode())),
                                    purpose="batch")
    created = time.time()
    batch = await api.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                     completion_window="24h")
    return BatchRun(batch.id, lines, created)


async def watch(api: openai.AsyncOpenAI, run: BatchRun, limit_s: float,
                until: Callable[[BatchRun], bool] = lambda r: False) -> None:
    """Poll every POLL_S until ``until`` holds or the batch is final."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        batch = await api.batches.retrieve(run.id)
        c = batch.request_counts
        run.timeline.append((time.time(), batch.status, c.completed if c else 0,
                             c.failed if c else 0))
        if run.final or until(run):
            return
        await asyncio.sleep(POLL_S)
    raise BenchError(f"batch {run.id}: {run.status} with {run.done}/{run.total} lines "
                     f"after {limit_s:.0f} s")


async def load(side: Side, into: Interactive | None, count: int, meter: CpuMeter,
               stop: Callable[[], bool] = lambda: False) -> None:
    """CONCURRENCY lanes, each sending one request after another, until ``count``
    have been sent or ``stop()`` holds."""
    started, begin, cpu = 0, time.time(), meter.read()

    async def lane() -> None:
        nonlocal started
        while started < count and not stop():
            started += 1
            sample = await side.one(paced=True)
            if into is not None:
                into.tally.samples.append(sample)

    await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))
    if into is not None:
        into.windows.append((begin, time.time()))
        into.tally.busy_s += into.windows[-1][1] - begin
        cpu_since(meter, cpu, into.cpu)


async def measure(p: Plan, f: Figures, gateway_url: str, flight: InFlight) -> None:
    limit = p.lines * f.line_s / SLOTS * 3 + 60
    async with make_client() as http, openai.AsyncOpenAI(
            base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=60) as api:
        side = Side("conveyor", f"{gateway_url}/v1/completions",
                    {True: "bench-paced", False: "bench-unpaced"}, http)
        try:
            await asyncio.wait_for(flight.all_ready.wait(), 180)
        except TimeoutError as exc:
            raise BenchError(f"not {WORKERS} workers ready after 180 s: {flight.beats}") from exc
        await first_success(side, 180.0)
        await load(side, None, 2 * CONCURRENCY, f.meter)
        await asyncio.sleep(f.settings.interactive_linger_s + 1)  # no interactive traffic around
        print(f"1. batch alone: {p.lines} lines ..." + _load(), flush=True)
        f.alone_batch, cpu = await start_batch(api, p.lines), f.meter.read()
        await watch(api, f.alone_batch, limit)
        cpu_since(f.meter, cpu, f.batch_cpu)
        await alone(p, f, side, "before", limit)
        print(f"3. interactive + batch: {p.lines} lines, up to {p.beside} requests ..."
              + _load(), flush=True)
        run = f.beside_batch = await start_batch(api, p.lines)
        await watch(api, run, limit, lambda r: r.status == "in_progress" and r.done >= SLOTS)
        poller = asyncio.create_task(watch(api, run, limit))
        try:
            # warm-up: the batch gives up slots down to its cap
            await load(side, None, CONCURRENCY, f.meter)
            began = run.done
            await asyncio.wait_for(load(side, f.beside, p.beside, f.meter,
                                        lambda: run.total - run.done < 2 * f.cap), limit)
            f.beside_done = (began, run.done)
            await poller
        finally:
            poller.cancel()
        await asyncio.sleep(f.settings.interactive_linger_s + 1)
        await alone(p, f, side, "after", limit)


def _load() -> str:
    return f" (load average {os.getloadavg()[0]:.2f})"


async def alone(p: Plan, f: Figures, side: Side, half: str, limit_s: float) -> None:
    print(f"2. interactive alone ({half}): {p.alone} requests ..." + _load(), flush=True)
    f.halves.append(Interactive(f"interactive alone ({half})"))
    await load(side, None, CONCURRENCY, f.meter)
    await asyncio.wait_for(load(side, f.halves[-1], p.alone, f.meter), limit_s)


# Processes


async def _main(p: Plan, f: Figures, gateway_url: str) -> None:
    flight = InFlight(f.settings)
    ready = asyncio.Event()
    follower = asyncio.create_task(flight.run(ready))
    try:
        await asyncio.wait_for(ready.wait(), 60)
        await measure(p, f, gateway_url, flight)
        await asyncio.sleep(1.0)  # the last records
        await flight.collect()
        report(f, flight)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


def run(quick: bool, delay_ms: int, upstream_port: int, gateway_port: int) -> None:
    check_infra()
    check_port_free(upstream_port, "upstream")
    check_port_free(gateway_port, "gateway")
    script = conveyor_script()
    work = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    print(f"logs, registry and files in {work}; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    models = work / "models.toml"
    models.write_text(registry(delay_ms))
    prefix = f"benchbatch{int(time.time())}"
    env = conveyor_env(topic_prefix=prefix, gateway_port=gateway_port, models_file=models)
    env.update(CONVEYOR_AUTH="none", CONVEYOR_FILES_DIR=str(work / "files"))
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    commands = {"upstream": [sys.executable, "-m", "bench.upstream", "--port",
                             str(upstream_port), "--tokens", str(TOKENS), "--delay-ms",
                             str(delay_ms)], "layers": [str(script), "layer"]}
    for n in range(WORKERS):
        commands[f"infer-{n}"] = [str(script), "infer", "--engine", "openai", "--upstream",
                                  upstream_url, "--pool", POOL, "--capacity", str(CAPACITY),
                                  "--worker-id", f"bench-{n}"]
    commands["gateway"] = [str(script), "gateway"]
    with ExitStack() as stack:
        procs = {}
        for name, argv in commands.items():
            procs[name] = stack.enter_context(running(name, argv, work, env))
            if name == "upstream":
                wait_http(f"{upstream_url}/v1/models", procs[name], 30.0)
        wait_http(f"{gateway_url}/healthz", procs["gateway"], 180.0)
        meter = CpuMeter({"bench client": os.getpid(),
                          **{name: proc.popen.pid for name, proc in procs.items()}})
        plan = Plan(100, 16, 24) if quick else Plan(500, 60, 120)
        figures = Figures(delay_ms, Settings(topic_prefix=prefix), meter)
        asyncio.run(_main(plan, figures, gateway_url))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.batch",
        description="Interactive latency beside a batch, and a batch's share of capacity.")
    parser.add_argument("--quick", action="store_true",
                        help="batches of 100 lines, fewer requests")
    parser.add_argument("--delay-ms", type=int, default=20, help="pacing of every token")
    parser.add_argument("--upstream-port", type=int, default=9120)
    parser.add_argument("--gateway-port", type=int, default=8120)
    args = parser.parse_args(argv)
    exit_on_sigterm()
    try:
        run(args.quick, args.delay_ms, args.upstream_port, args.gateway_port)
    except BenchError as exc:
        print(f"bench.batch: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


if __name__ == "__main__":
    main()
