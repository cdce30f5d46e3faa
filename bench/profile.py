"""Where a request's CPU goes: per process, and per function inside each.

    python -m bench.profile [--seconds 20] [--concurrency 32] [--top 12] [--no-spy] [--paced]
    python -m bench.profile --concurrency 0    # idle: CPU a second, nothing sent

On the stage of ``bench.overhead`` (``bench.harness.pipeline``), streams at
``--concurrency`` for ``--seconds`` while it reads every process's CPU from
``/proc`` (Conveyor's, the broker, Redis, the fixture, this load generator)
and samples the stacks of Conveyor's processes with py-spy (root, or
``kernel.yama.ptrace_scope`` 0; ``--no-spy`` without). It prints CPU a
request per process, per function (own time, and time under aiokafka's
produce and fetch paths, Avro, OpenTelemetry: a function's share of its
process's samples times the process's CPU, so the tables add up), and the
records a request wrote to each of the run's topics.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.client import make_client
from bench.compare import Side
from bench.harness import loop_factory, pipeline

__all__ = ["main"]

_TICK = os.sysconf("SC_CLK_TCK")
# frames counted inclusively: time spent under them, whatever they called
_UNDER = {
    "aiokafka produce": ("aiokafka/producer",),
    "aiokafka fetch": ("aiokafka/consumer/fetcher",),
    "aiokafka protocol": ("aiokafka/protocol", "aiokafka/record"),
    "aiokafka conn": ("aiokafka/conn.py",),
    "avro": ("fastavro",),
    "opentelemetry": ("opentelemetry",),
    "asyncio loop": ("asyncio/base_events.py",),
}


@dataclass
class Proc:
    pid: int
    name: str

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process and its threads so far."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / _TICK


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += _children(p)
    return found


def _name(argv: list[str]) -> str:
    """A short name: the conveyor subcommand, or the program."""
    joined = " ".join(argv)
    if "kafka.Kafka" in joined:
        return "kafka broker"
    if argv and "redis-server" in argv[0]:
        return "redis"
    if "bench.upstream" in joined:
        return "upstream fixture"
    for i, arg in enumerate(argv):
        if arg.endswith("conveyor") or arg == "cli":
            rest = [a for a in argv[i + 1:] if not a.startswith("-")]
            return f"conveyor {rest[0]}" if rest else "conveyor"
    return Path(argv[0]).name if argv else "?"


def processes(root_pid: int) -> list[Proc]:
    """Conveyor's processes (``root_pid`` and below), the broker, Redis and the
    upstream fixture."""
    pids = {p: _cmdline(p) for p in _descendants(root_pid)}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in pids:
            argv = _cmdline(int(entry.name))
            if _name(argv) in ("kafka broker", "redis", "upstream fixture"):
                pids[int(entry.name)] = argv
    named = [Proc(pid, _name(argv)) for pid, argv in pids.items() if argv]
    seen: Counter[str] = Counter(p.name for p in named)
    for p in named:
        if seen[p.name] > 1:
            p.name = f"{p.name} [{p.pid}]"
    return named


async def load(side: Side, concurrency: int, seconds: float, paced: bool = False
               ) -> tuple[int, int]:
    """Streams (unpaced, or paced at the fixture's 10 ms a token), ``concurrency``
    at a time, for ``seconds``: (ok, failed)."""
    end = time.monotonic() + seconds
    ok = failed = 0

    async def stream() -> None:
        nonlocal ok, failed
        while time.monotonic() < end:
            sample = await side.one(paced)
            if sample.ok:
                ok += 1
            else:
                failed += 1

    if concurrency == 0:  # idle: what the processes spend with nothing to do
        await asyncio.sleep(seconds)
    await asyncio.gather(*(stream() for _ in range(concurrency)))
    return ok, failed


def spy(procs: list[Proc], seconds: float, folder: Path) -> list[subprocess.Popen[bytes]]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    spies = []
    for p in procs:
        if not p.name.startswith("conveyor"):
            continue
        spies.append(subprocess.Popen(
            [exe, "record", "--pid", str(p.pid), "--duration", str(int(seconds)), "--rate", "100",
             "--nonblocking", "--format", "raw", "--output", str(folder / f"{p.pid}.txt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


def _frame_name(frame: str) -> str:
    """``fn (path/to/file.py:12)`` -> ``fn (to/file.py)``."""
    fn, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    short = "/".join(path.split("/")[-2:])
    return f"{fn} ({short})"


def read_stacks(path: Path) -> tuple[Counter[str], Counter[str], int]:
    """Own samples by function, inclusive samples by :data:`_UNDER` group, total."""
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    total = 0
    if not path.exists():
        return own, under, 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f]
        if not frames:
            continue
        total += count
        own[_frame_name(frames[-1])] += count
        for group, needles in _UNDER.items():
            if any(n in f for f in frames for n in needles):
                under[group] += count
    return own, under, total


def report(procs: list[Proc], used: dict[int, float], requests: int, seconds: float,
           folder: Path | None, top: int) -> None:
    total_cpu = sum(used.values())
    # idle (no requests): the figures are a second's, not a request's
    per, unit = (requests, "a request") if requests else (seconds, "a second")
    print(f"\n{requests} requests in {seconds:.1f} s: {requests / seconds:.1f} req/s; "
          f"{total_cpu:.1f} CPU s in all, {total_cpu / per * 1e6:.0f} µs {unit}\n")
    print(f"| process | CPU s | µs {unit} | share |")
    print("|---|---|---|---|")
    for p in sorted(procs, key=lambda p: -used[p.pid]):
        print(f"| {p.name} | {used[p.pid]:.2f} | {used[p.pid] / per * 1e6:.0f} | "
              f"{used[p.pid] / total_cpu:.0%} |")
    if folder is None:
        return
    for p in sorted(procs, key=lambda p: -used[p.pid]):
        own, under, samples = read_stacks(folder / f"{p.pid}.txt")
        if not samples:
            continue
        per_sample = used[p.pid] / per * 1e6 / samples
        print(f"\n{p.name}: {used[p.pid] / per * 1e6:.0f} µs {unit}, {samples} samples\n")
        print(f"| under | µs {unit} | share |")
        print("|---|---|---|")
        for group, n in under.most_common():
            print(f"| {group} | {n * per_sample:.0f} | {n / samples:.0%} |")
        print(f"\n| function (own time) | µs {unit} | share |")
        print("|---|---|---|")
        for fn, n in own.most_common(top):
            print(f"| `{fn}` | {n * per_sample:.1f} | {n / samples:.0%} |")


def run(args: argparse.Namespace) -> None:
    with pipeline(args.upstream_port, args.gateway_port, "prof") as stage:
        procs = processes(stage.conveyor.popen.pid) + [Proc(os.getpid(), "load generator")]
        folder = None if args.no_spy else Path(tempfile.mkdtemp(prefix="conveyor-profile-"))

        async def measure() -> tuple[int, int, float, dict[int, float], Counter[str]]:
            async with make_client(args.concurrency + 8) as client:
                side = Side("conveyor", f"{stage.gateway_url}/v1/completions",
                            {False: "bench-unpaced", True: "bench-paced"}, client)
                print(f"warming up ({args.warmup_s:.0f} s)...", flush=True)
                await load(side, args.concurrency, args.warmup_s, args.paced)
                offsets = await topic_offsets(stage.bootstrap, stage.prefix)
                spies = [] if folder is None else spy(procs, args.seconds, folder)
                before = {p.pid: p.cpu_s() for p in procs}
                start = time.monotonic()
                ok, failed = await load(side, args.concurrency, args.seconds, args.paced)
                elapsed = time.monotonic() - start
                used = {p.pid: p.cpu_s() - before[p.pid] for p in procs}
                written = await topic_offsets(stage.bootstrap, stage.prefix)
                written.subtract(offsets)
                for s in spies:
                    s.wait(timeout=60)
                return ok, failed, elapsed, used, written

        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            ok, failed, elapsed, used, written = runner.run(measure())
        if failed:
            print(f"{failed} requests failed")
        report(procs, used, ok, elapsed, folder, args.top)
        if ok:
            print("\n" + records_line(written, stage.prefix, ok))


async def topic_offsets(bootstrap: str, prefix: str) -> Counter[str]:
    """How many records each topic of the run (named under ``prefix``) holds:
    the sum of its partitions' end offsets."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        cluster = await consumer._client.fetch_all_metadata()
        tps = [TopicPartition(topic, p) for topic in cluster.topics()
               if topic.startswith(prefix) for p in cluster.partitions_for_topic(topic) or ()]
        ends = await consumer.end_offsets(tps) if tps else {}
    finally:
        await consumer.stop()
    out: Counter[str] = Counter()
    for tp, end in ends.items():
        out[tp.topic] += end
    return out


def records_line(written: Counter[str], prefix: str, requests: int) -> str:
    """``records a request: tokens 2.05, replies 2.05, ...`` (topics written to, by name)."""
    cells = [f"{topic[len(prefix):].lstrip('.-_')} {n / requests:.2f}"
             for topic, n in sorted(written.items()) if n > 0]
    return "records a request: " + (", ".join(cells) if cells else "none")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32,
                        help="0: no load, what the processes spend idle, a second")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--no-spy", action="store_true", help="the per-process table only")
    parser.add_argument("--paced", action="store_true",
                        help="paced streams (a token every 10 ms), not unpaced")
    parser.add_argument("--upstream-port", type=int, default=9100)
    parser.add_argument("--gateway-port", type=int, default=8100)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
