"""How many streams at a GPU's decode rate Conveyor carries: the upstream
fixture called directly and Conveyor in front of it, every stream of a level
started together (a round ends when its last stream does), ``--rounds``
rounds a side, the first side alternating; TTFT, chunk gaps, streams/s,
errors and each process's CPU per streamed token. ``--tenants 2``: whether
one tenant's flood starves another's short requests; ``--soak N``: whether a
serving process grows over N streams, and with ``--console`` how fast each
console page answers with those N requests in the log. What each checks:
docs/benchmarks/index.md; the figures: docs/benchmarks/results/many-streams.md.

    python -m bench.streams [--levels 64,128,256,512] [--token-ms 33] [--rounds 2]
    python -m bench.streams --tenants 2 [--capacity 32] [--flood 128]
    python -m bench.streams --soak 100000 --levels 64 --tokens 16 --token-ms 1 [--console]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import secrets
import time
from pathlib import Path

import httpx

from bench.client import StreamClient
from bench.compare import Scenario, Side, Tally, run_rounds, sides
from bench.harness import (
    BenchError,
    Pipeline,
    as_script,
    conveyor_cli,
    loop_factory,
    pipeline,
)
from bench.stats import Check, check_table, markdown_table, ms, percentile

__all__ = ["main"]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds so far) of ``pid``, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _label(cmdline: str) -> str:
    """A Conveyor process's part, from its command line (``python -m cli infer ...``)."""
    for part in ("gateway", "layer", "accounting", "infer"):
        if f" {part}" in cmdline:
            return part
    return "up"


def processes(stage: Pipeline, upstream_pid: int) -> dict[str, list[int]]:
    """The pids to watch, by label: Conveyor's processes, the upstream, the
    broker, Redis and this process."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[0]
    out: dict[str, list[int]] = {"upstream": [upstream_pid], "loadgen": [os.getpid()]}
    tree = [stage.conveyor.popen.pid]
    while tree:
        pid = tree.pop()
        out.setdefault(_label(_cmdline(pid)), []).append(pid)
        tree += [child for child, parent in parents.items() if parent == pid]
    for pid in parents:
        line = _cmdline(pid)
        if "kafka.Kafka" in line:
            out.setdefault("broker", []).append(pid)
        elif line.startswith("redis-server"):
            out.setdefault("redis", []).append(pid)
    return out


def rss_mib(watched: dict[str, list[int]]) -> dict[str, float]:
    """Resident memory by label, MiB (a gone process counts nothing)."""
    def rss(pid: int) -> float:
        try:
            return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_MIB
        except OSError:
            return 0.0
    return {label: sum(rss(pid) for pid in pids) for label, pids in watched.items()}


def cpu_now(watched: dict[str, list[int]]) -> dict[str, float]:
    return {label: sum(s[1] for pid in pids if (s := _stat(pid)) is not None)
            for label, pids in watched.items()}


async def measure(args: argparse.Namespace, stage: Pipeline,
                  watched: dict[str, list[int]]) -> dict[int, dict[str, Tally]]:
    results: dict[int, dict[str, Tally]] = {}
    async with sides(stage, max(args.levels) + 8, {True: args.token_ms}, args.tokens,
                     120.0) as (direct, conveyor):
        for level in args.levels:
            print(f"{level} streams ...", flush=True)
            # the first level's first round a side warms connections, groups and caches
            sc = Scenario(f"{level} streams", "", level, True, int(level == args.levels[0]),
                          level * args.rounds, math.inf)
            run = await run_rounds(sc, direct, conveyor, lambda: cpu_now(watched))
            tallies = results[level] = {t.name: t for t in (run.base, run.variant)}
            print(markdown_table(*_rows({level: tallies}, sorted(watched))), flush=True)
            for name, tally in tallies.items():
                if tally.failed:
                    print(f"{name}: {len(tally.failed)} failed, the first: "
                          f"{tally.failed[0].error}", flush=True)
    return results


def _rows(results: dict[int, dict[str, Tally]],
          labels: list[str]) -> tuple[list[str], list[list[str]]]:
    header = ["streams", "side", "TTFT p50 ms", "TTFT p99 ms", "gap p50 ms", "gap p99 ms",
              "streams/s", "errors", *(f"{label} CPU ms/tok" for label in labels)]
    rows = []
    for level, tallies in results.items():
        for name, t in tallies.items():
            ttft = [s.ttft for s in t.ok]
            gaps = [g for s in t.ok for g in s.gaps]
            rows.append([str(level), name, ms(percentile(ttft, 50)), ms(percentile(ttft, 99)),
                         ms(percentile(gaps, 50)), ms(percentile(gaps, 99)), f"{t.rate:.1f}",
                         str(len(t.failed)),
                         *(f"{t.cpu_ms_per_token(label):.3f}" for label in labels)])
    return header, rows


def checks(results: dict[int, dict[str, Tally]]) -> list[Check]:
    """At the highest level: Conveyor's rate at least 90 % of direct's, TTFT p50
    at most direct's + 100 ms, chunk gaps p99 at most 80 ms, no errors."""
    level = max(results)
    direct, conveyor = results[level]["direct"], results[level]["conveyor"]
    key = f"{level} streams"
    ttft = percentile([s.ttft for s in conveyor.ok], 50) * 1000
    return [
        Check(key, "Conveyor streams/s (>= 90 % of direct)", conveyor.rate,
              round(0.9 * direct.rate, 1), ">=", "/s"),
        Check(key, "Conveyor TTFT p50 (<= direct + 100 ms)", ttft,
              round(percentile([s.ttft for s in direct.ok], 50) * 1000 + 100, 1), "<=", "ms"),
        Check(key, "Conveyor chunk gap p99", percentile(
            [g for s in conveyor.ok for g in s.gaps], 99) * 1000, 80, "<=", "ms"),
        Check(key, "Conveyor errors", len(conveyor.failed), 0, "<=", ""),
    ]


async def soak(args: argparse.Namespace, stage: Pipeline,
               watched: dict[str, list[int]]) -> list[Check]:
    """``args.soak`` streams, ``max(args.levels)`` at once, RSS every 10 s. The
    serving processes are checked from two thirds of the run to its end (the
    layers fill their memory of finished requests for a deadline and a grace
    first); the accounting app's window of request ids (100,000 offsets a
    partition) fills far later: it is shown, not checked."""
    sent, failed, started = 0, 0, time.monotonic()
    samples: list[tuple[float, int, dict[str, float]]] = []  # (s, sent, RSS by label)
    async with sides(stage, max(args.levels) + 8, {True: args.token_ms}, args.tokens,
                     120.0) as (_, side):

        async def lane() -> None:
            nonlocal sent, failed
            while sent < args.soak:
                sent += 1
                failed += not (await side.one(True)).ok

        async def sample() -> None:
            while True:
                samples.append((time.monotonic() - started, sent, rss_mib(watched)))
                print(f"{samples[-1][0]:6.0f} s {sent:>8} sent, {failed} failed, RSS MiB "
                      + " ".join(f"{k} {v:.0f}" for k, v in sorted(samples[-1][2].items())),
                      flush=True)
                await asyncio.sleep(10.0)

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(lane() for _ in range(max(args.levels))))
        sampler.cancel()
    elapsed = time.monotonic() - started
    samples.append((elapsed, sent, rss_mib(watched)))
    fifth, late = (next(s for s in samples if s[1] >= args.soak * share)
                   for share in (0.2, 2 / 3))
    rows = [[label, *(f"{s[2][label]:.0f}" for s in (fifth, late, samples[-1])),
             f"{max(s[2][label] for s in samples):.0f}"] for label in sorted(watched)]
    print(f"\n## {args.soak:,} streams, {max(args.levels)} at once: {failed} failed, "
          f"{elapsed:.0f} s, {args.soak / elapsed:.1f} streams/s\n")
    print(markdown_table(["process", f"RSS MiB at {fifth[1]:,}", f"at {late[1]:,}",
                          "at the end", "highest"], rows) + "\n")
    serving = [label for label in ("gateway", "layer", "infer", "up") if label in watched]
    return [Check("soak", f"{label} RSS at the end (<= 1.05 x at two thirds)",
                  samples[-1][2][label], round(1.05 * late[2][label], 1), "<=", "MiB")
            for label in serving] + [Check("soak", "failed", failed, 0, "<=", "")]


async def console_pages(stage: Pipeline, since_ms: int, model: str,
                        rounds: int = 20) -> list[Check]:
    """Each console page ``rounds`` times in turn, on the log the soak of
    ``model`` left (it began at ``since_ms``): p50 and p99 against 300 ms."""
    base = f"{stage.gateway_url}/console"
    rows = re.compile(r'data-request="(\w+)" data-tenant="([^"]*)"')
    async with httpx.AsyncClient(timeout=60.0) as http:
        newest = rows.findall((await http.get(f"{base}/requests/rows")).text)
        oldest = rows.findall((await http.get(
            f"{base}/requests/rows", params={"until": str(since_ms + 60_000)})).text)
        if not newest or not oldest:
            raise BenchError("the request index holds no request of the soak: is the "
                             "accounting app running?")
        tenant = newest[0][1]
        pages = {"overview": "/overview", "pipeline (live)": "/overview/pipeline",
                 "fleet (live)": "/fleet/rows", "requests, the tail": "/requests/rows",
                 "requests of a tenant and a model":
                     f"/requests/rows?tenant={tenant}&model={model}",
                 "requests that failed (none)": "/requests/rows?status=error",
                 "journey of the newest": f"/requests/{newest[0][0]}",
                 "journey of the first": f"/requests/{oldest[-1][0]}",
                 "dead letters": "/dead-letters", "usage, a day": f"/usage?tenant={tenant}"}
        took: dict[str, list[float]] = {name: [] for name in pages}
        for _ in range(rounds):
            for name, path in pages.items():
                started = time.perf_counter()
                answer = await http.get(base + path)
                took[name].append(time.perf_counter() - started)
                if answer.status_code != 200:
                    raise BenchError(f"{path}: {answer.status_code} {answer.text[:300]}")
    print(f"\n## The console's pages, {rounds} times each\n")
    print(markdown_table(["page", "p50 ms", "p99 ms"],
                         [[name, ms(percentile(t, 50)), ms(percentile(t, 99))]
                          for name, t in took.items()]) + "\n")
    return [Check("console", f"{name} p50 (<= 300 ms)", percentile(t, 50) * 1000, 300.0,
                  "<=", "ms") for name, t in took.items()]


async def tenants(args: argparse.Namespace, stage: Pipeline) -> list[Check]:
    """The small tenant's TTFT alone, beside the large tenant's flood, and
    queued as the large tenant; the target: beside the flood, within 2x of alone."""
    url, model = f"{stage.gateway_url}/v1/completions", f"bench-{args.token_ms}"
    keys = {tenant: conveyor_cli("conveyor keys create", "keys", "create", "--tenant", tenant,
                                 env=stage.env).strip().splitlines()[-1]
            for tenant in ("large", "small")}
    async with StreamClient(args.flood + 8, timeout_s=300.0) as large_client, \
            StreamClient(4, timeout_s=300.0) as small_client:
        large_client.headers["Authorization"] = f"Bearer {keys['large']}"
        large = Side("large", url, {True: model}, large_client, args.tokens)

        async def small(key: str) -> list[float]:
            small_client.headers["Authorization"] = f"Bearer {key}"
            side = Side("small", url, {True: model}, small_client, 16)
            samples = [await side.one(True) for _ in range(args.small_requests)]
            failed = [s.error for s in samples if not s.ok]
            if failed:
                raise BenchError(f"the small tenant's requests failed: {failed[0]}")
            return [s.ttft for s in samples]

        async def beside_flood(key: str) -> list[float]:
            stop = asyncio.Event()

            async def lane() -> None:
                while not stop.is_set():
                    await large.one(True)
            lanes = [asyncio.create_task(lane()) for _ in range(args.flood)]
            await asyncio.sleep(2 * args.tokens * args.token_ms / 1000)  # the pool fills
            try:
                return await small(key)
            finally:
                stop.set()
                await asyncio.gather(*lanes)

        alone = await small(keys["small"])
        print(f"alone: TTFT p50 {ms(percentile(alone, 50))} ms", flush=True)
        fair = await beside_flood(keys["small"])
        print(f"beside the flood: TTFT p50 {ms(percentile(fair, 50))} ms", flush=True)
        queued = await beside_flood(keys["large"])
    rows = [[name, ms(percentile(t, 50)), ms(percentile(t, 99)),
             f"{percentile(t, 50) / percentile(alone, 50):.1f}x"]
            for name, t in (("alone", alone), ("beside the large tenant's flood", fair),
                            ("with the large tenant's key", queued))]
    print(f"\n## A small tenant's TTFT, {args.flood} streams of a large one, "
          f"{args.capacity} slots\n")
    print(markdown_table(["small tenant's requests", "TTFT p50 ms", "TTFT p99 ms", "vs alone"],
                         rows))
    return [Check("2 tenants", "small tenant's TTFT p50 beside a flood (<= 2x alone)",
                  percentile(fair, 50) * 1000, round(2 * percentile(alone, 50) * 1000, 1),
                  "<=", "ms")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="64,128,256,512",
                        help="streams at once, comma-separated")
    parser.add_argument("--token-ms", type=int, default=33, help="time between tokens")
    parser.add_argument("--tokens", type=int, default=128, help="tokens a stream")
    parser.add_argument("--rounds", type=int, default=2, help="rounds a side at each level")
    parser.add_argument("--tenants", type=int, choices=(1, 2), default=1,
                        help="2: the fairness scenario between two tenants")
    parser.add_argument("--capacity", type=int, default=32,
                        help="--tenants 2: the pool's slots (requests in flight upstream)")
    parser.add_argument("--flood", type=int, default=128,
                        help="--tenants 2: the large tenant's streams at once")
    parser.add_argument("--small-requests", type=int, default=10,
                        help="--tenants 2: the small tenant's requests in each case")
    parser.add_argument("--soak", type=int, default=0,
                        help="streams to send through Conveyor alone, RSS sampled")
    parser.add_argument("--console", action="store_true",
                        help="--soak: then time each console page on the log it left")
    parser.add_argument("--upstream-port", type=int, default=9100)
    parser.add_argument("--gateway-port", type=int, default=8100)
    args = parser.parse_args(argv)
    args.levels = sorted(int(n) for n in args.levels.split(","))
    auth = {"CONVEYOR_AUTH": "keys", "CONVEYOR_AUTH_SECRET": secrets.token_hex(16)}
    with as_script("bench.streams"):
        with pipeline(args.upstream_port, args.gateway_port, "streams", tokens=args.tokens,
                      capacity=args.capacity if args.tenants == 2 else max(args.levels),
                      paces_ms=(args.token_ms,),
                      extra_env=auth if args.tenants == 2 else None) as stage, \
                asyncio.Runner(loop_factory=loop_factory()) as runner:
            if args.tenants == 2:
                print()
                print(check_table(runner.run(tenants(args, stage))))
                return
            watched = processes(stage, stage.upstream.popen.pid)
            if args.soak:
                began = int(time.time() * 1000)
                checks_ = runner.run(soak(args, stage, watched))
                if args.console:
                    checks_ += runner.run(console_pages(stage, began, f"bench-{args.token_ms}"))
                print(check_table(checks_))
                return
            results = runner.run(measure(args, stage, watched))
    print(f"\n## Streams at {1000 / args.token_ms:.0f} tokens/s, {args.tokens} tokens each\n")
    print(markdown_table(*_rows(results, sorted(watched))))
    print()
    print(check_table(checks(results)))


if __name__ == "__main__":
    main()
