"""One relay hop, aiokafka against librdkafka: latency alone and CPU an event.

    python -m bench.relay [--rounds 2] [--events 20000] [--single 300] [--paced 2000]

A relay process consumes ``A`` in a consumer group and produces each record
to ``B``, as a Conveyor layer does (manual commits every 200 ms, on uvloop). This
process writes to ``A`` with aiokafka and reads ``B`` with aiokafka, the same
for every variant; only the relay's clients change:

- ``aiokafka``: aiokafka's consumer and producer (Conveyor's default);
- ``rd-consumer``: a librdkafka consumer (``confluent-kafka``, one poll thread
  handing batches to the event loop) and aiokafka's producer;
- ``rd-both``: librdkafka for both.

Per variant and round: ``--single`` records one at a time (the next sent when
the last came out of ``B``: the hop's latency, p50/p99, the two fixed hops
of this process included), then ``--paced`` records a second for 5 s, sent
in ticks of 5 ms as a pipeline's load arrives (the relay's CPU an event, from
``/proc``, its threads included), then ``--events`` records with up to 256
in flight (the rate, and the CPU an event when every fetch is full).
Variants alternate in each round, so the machine's drift hits them alike.
Uses the broker of ``infra/kafka.sh`` on 127.0.0.1:9092 and deletes its
topics at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any

from bench.stats import percentile

BOOTSTRAP = "127.0.0.1:9092"
VARIANTS = ("aiokafka", "rd-consumer", "rd-both")
_TICKS = os.sysconf("SC_CLK_TCK")


# -- the relay (a child process) ------------------------------------------------

class _RdSource:
    """A librdkafka consumer whose records reach the event loop in batches.

    Every call on the consumer is made in its poll thread: a commit from
    another thread waited for ever (confluent-kafka 2.16), the handle taken
    again by ``poll`` each time it let go."""

    def __init__(self, topic: str, group: str) -> None:
        from confluent_kafka import Consumer

        self._consumer = Consumer({
            "bootstrap.servers": BOOTSTRAP, "group.id": group,
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 500, "fetch.min.bytes": 1,
            "socket.nagle.disable": True, "log_level": 3,
            "enable.partition.eof": False,
            # a synchronous commit from another thread waits for ever while
            # this one sits in consume(): commits are asynchronous, their
            # outcome served by consume() in the poll thread
            "on_commit": self._committed,
        })
        self._commits: deque[asyncio.Future[None]] = deque()
        self._calls: deque[Any] = deque()
        self._consumer.subscribe([topic])
        self._loop = asyncio.get_running_loop()
        self._ready: deque[list[Any]] = deque()
        self._event = asyncio.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        # every call on the consumer is made here: a call from another thread
        # waits for the handle, which consume() takes again at once
        while not self._stop.is_set():
            while self._calls:
                self._calls.popleft()()
            # poll() returns at the first record (consume() waits out its
            # timeout for a full batch); consume(timeout=0) takes what came with it
            first = self._consumer.poll(0.02)
            if first is None:
                continue
            got = [first, *self._consumer.consume(num_messages=499, timeout=0)]
            if got:
                self._loop.call_soon_threadsafe(self._hand, got)

    def _hand(self, got: list[Any]) -> None:
        self._ready.append(got)
        self._event.set()

    async def getmany(self, timeout_s: float) -> list[Any]:
        if not self._ready:
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), timeout_s)
            except TimeoutError:
                return []
        out: list[Any] = []
        while self._ready:
            out += self._ready.popleft()
        return out

    def _committed(self, error: Any, partitions: Any) -> None:
        self._loop.call_soon_threadsafe(self._settle, error)

    def _settle(self, error: Any) -> None:
        fut = self._commits.popleft()
        if error is not None:
            fut.set_exception(RuntimeError(str(error)))
        else:
            fut.set_result(None)

    async def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        from confluent_kafka import TopicPartition

        parts = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        fut = self._loop.create_future()
        self._commits.append(fut)
        self._calls.append(lambda: self._consumer.commit(offsets=parts, asynchronous=True))
        await fut

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._consumer.close()


async def _relay(variant: str, source: str, sink: str, group: str) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from topics.rdkafka import RdProducer, rd_config

    producer: Any
    if variant == "rd-both":
        producer = RdProducer(rd_config(BOOTSTRAP, idempotent=True, linger_ms=0,
                                        compression="none", max_event_bytes=1 << 20))
    else:
        producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all",
                                    enable_idempotence=True, linger_ms=0)
    await producer.start()
    rd = variant.startswith("rd-")
    consumer: Any
    if rd:
        consumer = _RdSource(source, group)
    else:
        consumer = AIOKafkaConsumer(source, bootstrap_servers=BOOTSTRAP, group_id=group,
                                    enable_auto_commit=False, auto_offset_reset="earliest",
                                    fetch_min_bytes=1, fetch_max_wait_ms=500)
        await consumer.start()
    print("ready", flush=True)
    pending: set[asyncio.Future[Any]] = set()
    offsets: dict[Any, int] = {}
    last_commit = time.monotonic()
    while True:
        if rd:
            records = [(m.topic(), m.partition(), m.offset(), m.key(), m.value())
                       for m in await consumer.getmany(0.2)]
        else:
            batch = await consumer.getmany(timeout_ms=200)
            records = [(r.topic, r.partition, r.offset, r.key, r.value)
                       for rs in batch.values() for r in rs]
        for topic, partition, offset, key, value in records:
            if value == b"stop":
                await asyncio.gather(*pending)
                await producer.stop()
                if rd:
                    consumer.close()
                else:
                    await consumer.stop()
                return
            fut = await producer.send(sink, value, key=key)
            pending.add(fut)
            fut.add_done_callback(pending.discard)
            offsets[(topic, partition)] = offset + 1
        if offsets and time.monotonic() - last_commit >= 0.2:
            await asyncio.gather(*pending)
            if rd:
                await consumer.commit(offsets)
            else:
                await consumer.commit({TopicPartition(t, p): o for (t, p), o in offsets.items()})
            offsets = {}
            last_commit = time.monotonic()


# -- the driver -----------------------------------------------------------------

def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


async def _round(variant: str, single: int, events: int,
                 paced_rate: float) -> dict[str, float]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    run = uuid.uuid4().hex[:8]
    source, sink = f"relay-{run}-a", f"relay-{run}-b"
    admin = AIOKafkaAdminClient(bootstrap_servers=BOOTSTRAP)
    await admin.start()
    await admin.create_topics([NewTopic(source, 1, 1), NewTopic(sink, 1, 1)])
    await asyncio.sleep(1.0)  # the new partitions have a leader
    child = subprocess.Popen([sys.executable, "-m", "bench.relay", "--relay", variant,  # noqa: ASYNC220
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


async def _main(rounds: int, single: int, events: int, paced_rate: float,
                variants: list[str]) -> None:
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for variant in order:
            figures = await _round(variant, single, events, paced_rate)
            results[variant].append(figures)
            print(f"round {r + 1} {variant:12} p50 {figures['p50']:.2f} ms  "
                  f"p99 {figures['p99']:.2f} ms  {figures['rate']:,.0f} events/s  "
                  f"relay CPU {figures['cpu_us']:.0f} us an event, "
                  f"{figures['paced_us']:.0f} paced", flush=True)
    print("\n| relay clients | hop + 2 fixed hops p50 | p99 | events/s | relay CPU an event "
          f"| the same at {paced_rate:,.0f} events/s |")
    print("|---|---|---|---|---|---|")
    for variant, rows in results.items():
        def mid(k: str, rows: list[dict[str, float]] = rows) -> str:
            return " / ".join(f"{row[k]:,.2f}" if k in ("p50", "p99") else f"{row[k]:,.0f}"
                              for row in rows)
        print(f"| {variant} | {mid('p50')} ms | {mid('p99')} ms | {mid('rate')} | "
              f"{mid('cpu_us')} us | {mid('paced_us')} us |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--relay":
        import uvloop  # the loop Conveyor's processes run on (cli/main.py)

        variant, source, sink, group = sys.argv[2:6]
        uvloop.run(_relay(variant, source, sink, group))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--single", type=int, default=300)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--paced", type=float, default=2000.0,
                        help="records a second of the paced phase (5 s)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    asyncio.run(_main(args.rounds, args.single, args.events, args.paced,
                      args.variants.split(",")))


if __name__ == "__main__":
    main()
