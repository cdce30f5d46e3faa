"""Chaos run: streamed load through a real Conveyor while its parts are broken
in turn, then a check against ``conveyor.tokens`` that every request got exactly
one answer identical to what the log holds, or a clear error.

    .venv/bin/python -m bench.chaos [--quick] [--faults worker,redis-flush]
                                    [--time-limit 420] [--max-requests 600]

The set-up, the faults, the outcomes and the exit codes: docs/benchmarks/index.md.
No fault starts after ``--time-limit`` seconds; requests then in flight get
their client deadline (the gateway's request timeout plus 20 s).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from bench.chaos_check import Report, judge, read_tokens
from bench.chaos_faults import FAULTS, Chaos, Conveyor, Heartbeats, Injected
from bench.chaos_load import Load, Record
from bench.harness import BenchError, as_script, conveyor_env
from conveyor.settings import Settings
from infra.services import OwnKafka, OwnRedis, ServiceError, free_port

__all__ = ["main"]

log = logging.getLogger("bench.chaos")

QUICK_FAULTS = ("worker", "redis-stop", "redis-flush-worker")
# about how long a fault takes from its strike to a healthy pipeline, quiet period aside
_FAULT_COST_S = {"kafka": 45.0}  # the others about 25 s
WORKERS = ["w0", "w1"]


def _options(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--faults", default=None,
                   help=f"comma-separated subset, in order (all: {','.join(FAULTS)})")
    p.add_argument("--quick", action="store_true",
                   help=f"about 2 minutes: {','.join(QUICK_FAULTS)}, short quiet periods")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which no fault starts (default 420, quick 150)")
    p.add_argument("--max-requests", type=int, default=600, help="requests sent in all")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quiet", type=float, default=None,
                   help="seconds of plain load after each fault (default 12, quick 5)")
    p.add_argument("--baseline", type=float, default=None,
                   help="seconds of load before the first fault (default 15, quick 8)")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="the gateway's request deadline (CONVEYOR_REQUEST_TIMEOUT_S)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where services keep data and logs (default a new /tmp folder)")
    opts = p.parse_args(argv)
    names = opts.faults.split(",") if opts.faults else list(
        QUICK_FAULTS if opts.quick else FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        p.error(f"unknown fault {unknown[0]!r}; choose from {', '.join(FAULTS)}")
    opts.fault_names = names
    opts.time_limit = opts.time_limit or (150.0 if opts.quick else 420.0)
    opts.quiet = opts.quiet if opts.quiet is not None else (5.0 if opts.quick else 12.0)
    opts.baseline = opts.baseline if opts.baseline is not None else (8.0 if opts.quick else 15.0)
    return opts


async def _supervise(conveyor: Conveyor) -> None:
    """Start again what died on its own, as a supervisor would (and say so)."""
    while True:
        for name in conveyor.reap():
            code = conveyor.unexpected[-1][2]
            log.warning("%s exited on its own (code %s): starting it again", name, code)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(conveyor.start, name)
        await asyncio.sleep(0.5)


def _reference(records: list[Record], before: float) -> dict[int, str]:
    """Each prompt's first complete answer before any fault."""
    return {r.prompt: r.text for r in reversed(records)  # the first one written last
            if r.ended is not None and r.ended < before and r.finished and r.error is None}


async def _drive(opts: argparse.Namespace, chaos: Chaos, t0: float) -> tuple[
        list[Injected], list[str]]:
    """Baseline load, then each fault with a recovery and a quiet period."""
    chaos.load.start()
    log.info("load: %d clients, max_tokens %d; baseline %.0f s", opts.clients,
             opts.max_tokens, opts.baseline)
    await asyncio.sleep(opts.baseline)
    skipped: list[str] = []
    for name in opts.fault_names:
        cost = _FAULT_COST_S.get(name, 25.0) + opts.quiet
        if time.monotonic() - t0 + cost > opts.time_limit or chaos.load.exhausted:
            skipped.append(name)
            continue
        await chaos.wait_streaming()
        event = await FAULTS[name](chaos)
        event.restored_at = time.monotonic()
        if await chaos.recovered():
            log.info("fault %s: answering again %.1f s after the strike", name,
                     time.monotonic() - event.injected_at)
        else:
            event.notes.append("NOT answering again within 90 s")
            log.warning("fault %s: NOT answering again %.1f s after the strike", name,
                        time.monotonic() - event.injected_at)
        await asyncio.sleep(opts.quiet)
    return chaos.injected, skipped


async def _run(opts: argparse.Namespace, conveyor: Conveyor, redis: OwnRedis,
               kafka: OwnKafka, base_url: str, t0: float) -> bool:
    settings = Settings.from_flat({k.removeprefix("CONVEYOR_").lower(): v
                                   for k, v in conveyor.env.items() if k.startswith("CONVEYOR_")})
    beats = Heartbeats(settings)
    load = Load(base_url, opts.clients, opts.max_tokens, opts.max_requests,
                client_deadline_s=opts.request_timeout + 20.0)
    chaos = Chaos(conveyor, redis, kafka, load, beats, base_url)
    background = [asyncio.create_task(beats.follow()), asyncio.create_task(_supervise(conveyor))]
    try:
        if not await chaos.recovered(within=240.0, starting=True):
            raise BenchError("Conveyor did not become ready:\n" + "\n".join(
                p.log_tail(15) for p in conveyor.procs.values()))
        log.info("Conveyor ready after %.0f s", time.monotonic() - t0)
        try:
            injected, skipped = await _drive(opts, chaos, t0)
        except BaseException:
            load.abort()  # Ctrl-C or a failure: no drain, tear down at once
            raise
        load.stop()
        log.info("load stopped; waiting for %d requests in flight", len(load.in_flight()))
        await load.drain()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    logged = await read_tokens(settings)
    first = injected[0].injected_at if injected else float("inf")
    verdicts = judge(load.records, logged, _reference(load.records, first))
    report = Report(verdicts, injected, conveyor.unexpected, skipped)
    print("\n".join(report.lines()), flush=True)
    ok, line = report.verdict()
    print(line, flush=True)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    opts = _options(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="[%(relativeCreated)7.0f ms] %(message)s")
    for noisy in ("aiokafka", "kafka", "httpx"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    t0 = time.monotonic()
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="conveyor-chaos-"))
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"chaos: faults {','.join(opts.fault_names)}; logs in {logs}", flush=True)
    with as_script("chaos", (BenchError, ServiceError)), ExitStack() as stack:
        redis = OwnRedis(workdir)
        stack.callback(redis.stop, signal.SIGKILL)
        kafka = OwnKafka(workdir)
        stack.callback(kafka.close)
        redis.start()
        kafka.start()  # the jars linked (fetched once) first
        log.info("own Redis on %s, own Kafka on %s", redis.url, kafka.bootstrap)
        prefix = f"chaos{int(time.time())}"
        port = free_port()
        env = conveyor_env(topic_prefix=prefix, gateway_port=port, services={
            "CONVEYOR_KAFKA_BOOTSTRAP": kafka.bootstrap, "CONVEYOR_REDIS_URL": redis.url,
            "CONVEYOR_REQUEST_TIMEOUT_S": str(opts.request_timeout)})
        conveyor = Conveyor(logs, env, list(WORKERS))
        stack.callback(conveyor.close)
        conveyor.topics()
        conveyor.start_all()
        ok = asyncio.run(_run(opts, conveyor, redis, kafka, f"http://127.0.0.1:{port}", t0))
    print(f"chaos: done in {time.monotonic() - t0:.0f} s; logs in {logs}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("chaos: interrupted; everything it started is stopped", file=sys.stderr)
        sys.exit(130)
