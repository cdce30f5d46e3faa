"""One relay hop on Conveyor's Kafka client (aiokafka): latency alone and CPU an event.

    python -m bench.relay [--rounds 2] [--events 20000] [--single 300] [--paced 2000]

A relay process consumes ``A`` in a consumer group and produces each record
to ``B``, as a Conveyor layer does (manual commits every 200 ms, on uvloop,
an idempotent producer with acks=all). This process writes to ``A`` and reads
``B``, both with aiokafka.

Per round: ``--single`` records one at a time (the next sent when the last
came out of ``B``: the hop's latency, p50/p99, the two fixed hops of this
process included), then ``--paced`` records a second for 5 s, sent in ticks
of 5 ms as a pipeline's load arrives (the relay's CPU an event, from
``/proc``, its threads included), then ``--events`` records with up to 256
in flight (the rate, and the CPU an event when every fetch is full).
Uses the broker of ``infra/kafka.sh`` on 127.0.0.1:9092 and deletes its
topics at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import uuid
from typing import Any

from bench.stats import percentile

BOOTSTRAP = "127.0.0.1:9092"
_TICKS = os.sysconf("SC_CLK_TCK")


# -- the relay (a child process) ------------------------------------------------

async def _relay(source: str, sink: str, group: str) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all",
                                enable_idempotence=True, linger_ms=0)
    consumer = AIOKafkaConsumer(source, bootstrap_servers=BOOTSTRAP, group_id=group,
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                fetch_min_bytes=1, fetch_max_wait_ms=500)
    await producer.start()
    await consumer.start()
    print("ready", flush=True)
    pending: set[asyncio.Future[Any]] = set()
    offsets: dict[TopicPartition, int] = {}
    last_commit = time.monotonic()
    while True:
        batch = await consumer.getmany(timeout_ms=200)
        for tp, records in batch.items():
            for record in records:
                if record.value == b"stop":
                    await asyncio.gather(*pending)
                    await producer.stop()
                    await consumer.stop()
                    return
                fut = await producer.send(sink, record.value, key=record.key)
                pending.add(fut)
                fut.add_done_callback(pending.discard)
                offsets[tp] = record.offset + 1
        if offsets and time.monotonic() - last_commit >= 0.2:
            await asyncio.gather(*pending)
            await consumer.commit(offsets)
            offsets = {}
            last_commit = time.monotonic()


# -- the driver -----------------------------------------------------------------

def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


async def _round(single: int, events: int, paced_rate: float) -> dict[str, float]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    run = uuid.uuid4().hex[:8]
    source, sink = f"relay-{run}-a", f"relay-{run}-b"
    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    await admin.start()
    await admin.create_topics([NewTopic(source, 1, 1), NewTopic(sink, 1, 1)])
    await asyncio.sleep(1.0)  # the new partitions have a leader
    child = subprocess.Popen([sys.executable, "-m", "bench.relay", "--relay",  # noqa: ASYNC220
                              source, sink, f"relay-{run}"], stdout=subprocess.PIPE, text=True)
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all", linger_ms=0)
    reader = AIOKafkaConsumer(sink, bootstrap_servers=BOOTSTRAP, auto_offset_reset="earliest",
                              fetch_min_bytes=1, fetch_max_wait_ms=500)
    await producer.start()
    await reader.start()
    try:
        assert child.stdout is not None
        await asyncio.to_thread(child.stdout.readline)
        await producer.send_and_wait(source, b"warm", key=b"w")  # the group holds A
        await _take(reader, 1)
        latencies = []
        for i in range(single):
            t0 = time.perf_counter()
            await producer.send_and_wait(source, b"x" * 200, key=str(i).encode())
            await _take(reader, 1)
            latencies.append((time.perf_counter() - t0) * 1000)
        cpu0 = _cpu_s(child.pid)
        paced_n = await _paced(producer, reader, source, paced_rate, 5.0)
        paced_cpu = (_cpu_s(child.pid) - cpu0) / paced_n * 1e6
        cpu0, t0 = _cpu_s(child.pid), time.perf_counter()
        sent = asyncio.create_task(_send(producer, source, events))
        await _take(reader, events)
        elapsed = time.perf_counter() - t0
        cpu = _cpu_s(child.pid) - cpu0
        await sent
        await producer.send_and_wait(source, b"stop", key=b"s")
        await asyncio.to_thread(child.wait, 30)
    finally:
        if child.poll() is None:
            child.kill()
        await producer.stop()
        await reader.stop()
        await admin.delete_topics([source, sink])
        await admin.close()
    return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
            "rate": events / elapsed, "cpu_us": cpu / events * 1e6, "paced_us": paced_cpu}


async def _paced(producer: Any, reader: Any, topic: str, rate: float, seconds: float) -> int:
    """``rate`` records a second for ``seconds``, sent in ticks of 5 ms (a
    pipeline's load: a fetch finds one or a few records); how many."""
    n = int(rate * seconds)
    per_tick = max(1, round(rate * 0.005))
    start = time.perf_counter()
    reading = asyncio.create_task(_take(reader, n))
    sent = 0
    while sent < n:
        for _ in range(min(per_tick, n - sent)):
            await producer.send(topic, b"x" * 200, key=str(sent).encode())
            sent += 1
        await asyncio.sleep(max(0.0, start + sent / rate - time.perf_counter()))
    await reading
    return n


async def _send(producer: Any, topic: str, n: int) -> None:
    window: set[asyncio.Future[Any]] = set()
    for i in range(n):
        if len(window) >= 256:
            _, window = await asyncio.wait(window, return_when=asyncio.FIRST_COMPLETED)
        window.add(await producer.send(topic, b"x" * 200, key=str(i).encode()))
    await asyncio.gather(*window)


async def _take(reader: Any, n: int) -> None:
    got = 0
    while got < n:
        batch = await reader.getmany(timeout_ms=1000)
        got += sum(len(records) for records in batch.values())


async def _main(rounds: int, single: int, events: int, paced_rate: float) -> None:
    rows = []
    for r in range(rounds):
        figures = await _round(single, events, paced_rate)
        rows.append(figures)
        print(f"round {r + 1} p50 {figures['p50']:.2f} ms  "
              f"p99 {figures['p99']:.2f} ms  {figures['rate']:,.0f} events/s  "
              f"relay CPU {figures['cpu_us']:.0f} us an event, "
              f"{figures['paced_us']:.0f} paced", flush=True)

    def each(k: str) -> str:
        return " / ".join(f"{row[k]:,.2f}" if k in ("p50", "p99") else f"{row[k]:,.0f}"
                          for row in rows)
    print("\n| hop + 2 fixed hops p50 | p99 | events/s | relay CPU an event "
          f"| the same at {paced_rate:,.0f} events/s |")
    print("|---|---|---|---|---|")
    print(f"| {each('p50')} ms | {each('p99')} ms | {each('rate')} | "
          f"{each('cpu_us')} us | {each('paced_us')} us |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--relay":
        import uvloop  # the loop Conveyor's processes run on (cli/main.py)

        source, sink, group = sys.argv[2:5]
        uvloop.run(_relay(source, sink, group))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--single", type=int, default=300)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--paced", type=float, default=2000.0,
                        help="records a second of the paced phase (5 s)")
    args = parser.parse_args()
    asyncio.run(_main(args.rounds, args.single, args.events, args.paced))


if __name__ == "__main__":
    main()
