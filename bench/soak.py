"""A long run at c=32, unpaced: the rate held, and every process's memory.

``python -m bench.overhead --soak N`` starts the ``bench.overhead`` stack and
sends ``N`` streamed completions through Conveyor, ``--concurrency`` at a
time, while it samples every process's resident memory (``VmRSS`` in
``/proc``: Conveyor's processes, the broker, Redis) every ``--sample-s``
seconds. It prints one row a sample (requests so far, the rate over the
sample, each process's RSS) and then, per process, RSS at the end of the
first fifth of the run (after warm-up) against its last sample: a leak grows
with the requests, so the flat target is that growth, not the first
sample's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.client import make_client
from bench.profile import Proc, processes
from bench.scenarios import Side

__all__ = ["Soak", "rss_mib", "soak"]


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class Soak:
    procs: list[Proc]
    # (seconds since the start, requests done, {pid: RSS MiB})
    samples: list[tuple[float, int, dict[int, float]]] = field(default_factory=list)
    ok: int = 0
    failed: int = 0

    def sample(self, elapsed: float) -> None:
        self.samples.append((elapsed, self.ok, {p.pid: rss_mib(p.pid) for p in self.procs}))

    def report(self) -> None:
        names = [p.name for p in self.procs]
        print("| s | requests | req/s | " + " | ".join(f"{n} MiB" for n in names) + " |")
        print("|---|---|---|" + "---|" * len(names))
        last_t, last_n = 0.0, 0
        for t, n, rss in self.samples:
            rate = (n - last_n) / (t - last_t) if t > last_t else 0.0
            last_t, last_n = t, n
            print(f"| {t:.0f} | {n} | {rate:.1f} | "
                  + " | ".join(f"{rss[p.pid]:.0f}" for p in self.procs) + " |")
        if len(self.samples) < 2:
            return
        settled = self.samples[max(1, len(self.samples) // 5)]
        end = self.samples[-1]
        print(f"\n{self.ok} requests ({self.failed} failed) in {end[0]:.0f} s: "
              f"{self.ok / end[0]:.1f} req/s")
        print("\n| process | RSS after a fifth of the run | at the end | growth |")
        print("|---|---|---|---|")
        for p in self.procs:
            a, b = settled[2][p.pid], end[2][p.pid]
            print(f"| {p.name} | {a:.0f} MiB | {b:.0f} MiB | {b - a:+.0f} MiB |")


async def soak(side: Side, procs: list[Proc], requests: int, concurrency: int,
               sample_s: float) -> Soak:
    """Send ``requests`` unpaced streams through ``side``, ``concurrency`` at a
    time, sampling RSS every ``sample_s`` seconds."""
    run = Soak(procs)
    start = time.monotonic()
    left = requests

    async def lane() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            sample = await side.one(False)
            if sample.ok:
                run.ok += 1
            else:
                run.failed += 1

    async def sampler() -> None:
        while True:
            run.sample(time.monotonic() - start)
            await asyncio.sleep(sample_s)

    sampling = asyncio.create_task(sampler())
    try:
        await asyncio.gather(*(lane() for _ in range(concurrency)))
    finally:
        sampling.cancel()
    run.sample(time.monotonic() - start)
    return run


def run_soak(gateway_url: str, conveyor_pid: int, requests: int, concurrency: int,
             sample_s: float) -> Soak:
    from bench.compare import loop_factory

    procs = [p for p in processes(conveyor_pid) if p.name != "upstream fixture"]

    async def go() -> Soak:
        async with make_client(concurrency + 8) as client:
            side = Side("conveyor", f"{gateway_url}/v1/completions",
                        {False: "bench-unpaced", True: "bench-paced"}, client)
            return await soak(side, procs, requests, concurrency, sample_s)

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(go())
