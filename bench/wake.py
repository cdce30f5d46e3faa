"""What one hop costs when the machine was idle before it: back to back against
after a pause.

    python -m bench.wake [--rounds 2] [-n 100] [--gaps-ms 0,1,5,20,100]

A request at concurrency 1 (and each paced token) finds Conveyor's processes
and the broker asleep: every hop wakes a producer, the broker's threads and a
consumer. This measures what that waking costs on the machine it runs on,
with nothing of Conveyor's own work in it. For each pause between one probe
and the next:

- ``tcp``: a one-byte round trip over loopback TCP to an echo process: two
  processes woken, no Kafka;
- ``ack``: a record produced and acknowledged, on Conveyor's producer
  (``topics.clients.make_producer``: acks=all, idempotent, linger 0);
- ``hop``: the same record fetched by a group consumer of Conveyor's settings
  (``make_consumer``) in this process: one hop of the pipeline without a
  layer's own work.

The pauses alternate in order from one round to the next, so the machine's
drift hits them alike. Uses the broker of ``infra/kafka.sh`` (or
``CONVEYOR_KAFKA_BOOTSTRAP``) and deletes its topic at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from bench.compare import loop_factory
from bench.stats import markdown_table, percentile
from conveyor.settings import Settings, load_settings

__all__ = ["PROBES", "Samples", "echo_server", "kafka_probes", "report", "tcp_probes"]

PROBES = ("tcp", "ack", "hop")
# (probe, pause in ms) -> latencies in ms
Samples = dict[tuple[str, float], list[float]]


@contextmanager
def echo_server() -> Iterator[int]:
    """An echo process on a loopback port (yielded), stopped at the end."""
    child = subprocess.Popen([sys.executable, "-m", "bench.wake", "--echo"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        yield int(child.stdout.readline())
    finally:
        child.kill()
        child.wait()


def _echo() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    while True:  # one connection at a time, until killed
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)


def tcp_probes(port: int, n: int, gap_s: float) -> list[float]:
    """``n`` one-byte round trips to the echo process, ``gap_s`` apart (ms each)."""
    out = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            start = time.perf_counter()
            sock.sendall(b"x")
            sock.recv(64)
            out.append((time.perf_counter() - start) * 1000)
            if gap_s:
                time.sleep(gap_s)
    return out


class KafkaProbe:
    """A one-partition topic, Conveyor's producer and a group consumer of it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = f"wake-{uuid.uuid4().hex[:8]}"

    async def __aenter__(self) -> KafkaProbe:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        from topics.clients import make_consumer, make_producer

        self.admin = AIOKafkaAdminClient(bootstrap_servers=self.settings.kafka_bootstrap)
        await self.admin.start()
        await self.admin.create_topics([NewTopic(self.topic, 1, 1)])
        self.producer = make_producer(self.settings)
        await self.producer.start()
        self.consumer = make_consumer(self.settings, self.topic, group=self.topic)
        await self.consumer.start()
        await self.producer.send_and_wait(self.topic, b"warm", key=b"w")
        await self._take()  # the group holds the partition
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()
        await self.producer.stop()
        await self.admin.delete_topics([self.topic])
        await self.admin.close()

    async def _take(self) -> None:
        while not await self.consumer.getmany(timeout_ms=1000):
            pass

    async def probe(self) -> tuple[float, float]:
        """One record: (ms until acknowledged, ms until the consumer had it)."""
        start = time.perf_counter()
        fut = await self.producer.send(self.topic, b"x" * 300, key=uuid.uuid4().bytes)
        acked = asyncio.ensure_future(_when_done(fut))
        await self._take()
        fetched = time.perf_counter()
        return (await acked - start) * 1000, (fetched - start) * 1000


async def _when_done(fut: asyncio.Future[object]) -> float:
    await fut
    return time.perf_counter()


async def kafka_probes(probe: KafkaProbe, n: int, gap_s: float) -> tuple[list[float], list[float]]:
    """``n`` probes ``gap_s`` apart: their ack and hop latencies (ms)."""
    acks, hops = [], []
    for _ in range(n):
        ack, hop = await probe.probe()
        acks.append(ack)
        hops.append(hop)
        if gap_s:
            await asyncio.sleep(gap_s)
    return acks, hops


def report(samples: Samples, gaps_ms: Sequence[float]) -> str:
    """One row a pause: p50 / p90 of each probe, and the hop's p50 over the back-to-back one."""
    rows = []
    base = percentile(samples.get(("hop", gaps_ms[0]), []), 50)
    for gap in gaps_ms:
        cells = [f"{gap:g} ms"]
        for name in PROBES:
            values = samples.get((name, gap), [])
            cells.append(f"{percentile(values, 50):.2f} / {percentile(values, 90):.2f}")
        hop = percentile(samples.get(("hop", gap), []), 50)
        cells.append(f"{hop / base:.2f}x")
        rows.append(cells)
    return markdown_table(["pause before each probe", "tcp round trip p50 / p90 ms",
                           "produce ack p50 / p90 ms", "hop p50 / p90 ms",
                           f"hop p50 / at {gaps_ms[0]:g} ms"], rows)


async def _kafka_rounds(settings: Settings, rounds: int, n: int, gaps_ms: list[float],
                        samples: Samples, port: int) -> None:
    async with KafkaProbe(settings) as probe:
        for r in range(rounds):
            for gap in gaps_ms if r % 2 == 0 else gaps_ms[::-1]:
                # in a thread: the consumer keeps its group while this one sleeps
                samples[("tcp", gap)] += await asyncio.to_thread(tcp_probes, port, n, gap / 1000)
                acks, hops = await kafka_probes(probe, n, gap / 1000)
                samples[("ack", gap)] += acks
                samples[("hop", gap)] += hops
                print(f"round {r + 1}, pause {gap:g} ms: hop p50 "
                      f"{percentile(hops, 50):.2f} ms", flush=True)


def main(argv: list[str] | None = None) -> None:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--echo"]:
        _echo()
        return
    parser = argparse.ArgumentParser(prog="python -m bench.wake",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("-n", type=int, default=100, help="probes a pause and round")
    parser.add_argument("--gaps-ms", default="0,1,5,20,100")
    args = parser.parse_args(args_in)
    gaps = [float(g) for g in args.gaps_ms.split(",")]
    samples: Samples = defaultdict(list)
    with echo_server() as port, asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_kafka_rounds(load_settings(), max(1, args.rounds), max(1, min(args.n, 10_000)),
                                 gaps, samples, port))
    print()
    print(report(samples, gaps))


if __name__ == "__main__":
    main()
