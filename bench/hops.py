"""Where a request's time goes, hop by hop, from the envelope's per-layer stamps.

    python -m bench.hops --prefix PREFIX --gateway http://127.0.0.1:8000 --model NAME [-n 100]
        [--load 32 --load-model NAME]

Sends ``n`` streamed completions one at a time through a running Conveyor
(with ``--load``, while that many other streams of ``--load-model`` run back
to back beside them: where a request's time goes on a busy pipeline),
reads the replies those requests produced on ``<prefix>.replies`` and prints
p50/p99 of each hop: the time from one layer taking the event to the next
layer taking it (a produce, a fetch and the layer's own work), then from
postprocess to the first byte at the client. Every stamp is taken on this
machine's clock, so run it where all processes share one host.

It then splits each hop in two with the timestamp the producer gave the
layer's output record (its CreateTime, set when the layer sent it): the
layer's own work (taking the event to sending its output: decode, handle,
encode) and the transit (sending to the next layer taking it: the
producer, the broker, the fetch). CreateTime is in whole milliseconds, so
these are means over the probes with half a millisecond added to each
CreateTime (a truncated time is on average that much early).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.stats import percentile
from schemas.codec import default_codec

HOPS = ("gateway", "preprocess", "route", "schedule", "infer", "postprocess")
# the topic each layer of HOPS writes the request's next event to (infer's pool
# topic is found by its prefix), keyed by request id but for replies
OUTPUTS = ("requests", "prepared", "routed", "infer.", "tokens", "replies")


async def background(gateway: str, model: str, streams: int, stop: asyncio.Event) -> int:
    """``streams`` streamed completions of ``model`` back to back until ``stop``;
    how many ended."""
    done = 0
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def lane() -> None:
            nonlocal done
            while not stop.is_set():
                async with client.stream("POST", f"{gateway}/v1/completions", json={
                        "model": model, "prompt": "hi", "max_tokens": 32,
                        "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass
                done += 1

        await asyncio.gather(*(lane() for _ in range(streams)))
    return done


async def measure(prefix: str, gateway: str, model: str, n: int, load: int = 0,
                  load_model: str = "") -> None:
    stop = asyncio.Event()
    loaded = asyncio.create_task(background(gateway, load_model or model, load, stop)) \
        if load else None
    try:
        await asyncio.sleep(2.0 if load else 0.0)  # the load is under way
        await _probe(prefix, gateway, model, n)
    finally:
        stop.set()
        if loaded is not None:
            print(f"(beside {load} streams of {load_model or model}: "
                  f"{await loaded} ended)")


async def _probe(prefix: str, gateway: str, model: str, n: int) -> None:
    codec = default_codec()
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9092",
                                auto_offset_reset="latest", enable_auto_commit=False)
    await consumer.start()
    await _assign_outputs(consumer, prefix)
    first_byte: dict[str, float] = {}
    sent: dict[str, float] = {}
    try:
        await asyncio.sleep(1.0)
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(n):
                t0 = time.time()
                async with client.stream("POST", f"{gateway}/v1/completions", json={
                    "model": model, "prompt": "hi", "max_tokens": 8, "stream": True,
                }) as r:
                    rid = ""
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and not rid:
                            rid = line.split('"id":"', 1)[1].split('"', 1)[0].split("-", 1)[1]
                            first_byte[rid] = time.time()
                            sent[rid] = t0
        stamps: dict[str, dict[str, int]] = {}
        # request id -> output (of OUTPUTS) -> its first record's CreateTime (ms)
        sent_at: dict[str, dict[str, int]] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(stamps) < len(first_byte):
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    output = _output_of(prefix, record.topic)
                    if output == "replies":
                        env = codec.decode(record.value, "Reply")["envelope"]
                        rid = env["request_id"]
                        stamps.setdefault(rid, env["stamps"])
                    elif record.key is None:
                        continue
                    else:
                        rid = record.key.decode(errors="replace")
                    sent_at.setdefault(rid, {}).setdefault(output, record.timestamp)
    finally:
        await consumer.stop()
    rows: dict[str, list[float]] = {"client -> gateway": []}
    for a, b in zip(HOPS, HOPS[1:], strict=False):
        rows[f"{a} -> {b}"] = []
    rows["postprocess -> client"] = []
    rows["client TTFT"] = []
    for rid, s in stamps.items():
        if rid not in first_byte or not all(h in s for h in HOPS):
            continue
        rows["client -> gateway"].append(s["gateway"] / 1000 - sent[rid] * 1000)
        for a, b in zip(HOPS, HOPS[1:], strict=False):
            rows[f"{a} -> {b}"].append((s[b] - s[a]) / 1000)
        rows["postprocess -> client"].append(first_byte[rid] * 1000 - s["postprocess"] / 1000)
        rows["client TTFT"].append((first_byte[rid] - sent[rid]) * 1000)
    print(f"{len(rows['client TTFT'])} requests; milliseconds")
    print(f"{'hop':28} {'p50':>8} {'p99':>8}")
    for name, values in rows.items():
        if values:
            print(f"{name:28} {percentile(values, 50):8.2f} {percentile(values, 99):8.2f}")
    print()
    print(split_table(split(stamps, sent_at)))


def split(stamps: dict[str, dict[str, int]], sent_at: dict[str, dict[str, int]]
          ) -> dict[str, tuple[list[float], list[float]]]:
    """Each layer's (own work, transit to the next layer) in ms, a list over the
    requests with every stamp and output time: stamps are µs, CreateTimes ms."""
    out: dict[str, tuple[list[float], list[float]]] = {h: ([], []) for h in HOPS}
    for rid, s in stamps.items():
        times = sent_at.get(rid, {})
        if not all(h in s for h in HOPS) or not all(o in times for o in OUTPUTS):
            continue
        for i, (hop, output) in enumerate(zip(HOPS, OUTPUTS, strict=True)):
            sent = times[output] + 0.5  # whole ms, truncated: on average half a ms early
            out[hop][0].append(sent - s[hop] / 1000)
            if i + 1 < len(HOPS):
                out[hop][1].append(s[HOPS[i + 1]] / 1000 - sent)
    return out


def split_table(parts: dict[str, tuple[list[float], list[float]]]) -> str:
    lines = [f"{'layer':12} {'own work, mean':>16} {'transit to the next, mean':>26}"]
    for hop, (own, transit) in parts.items():
        if own:
            after = f"{statistics.fmean(transit):26.2f}" if transit else f"{'-':>26}"
            lines.append(f"{hop:12} {statistics.fmean(own):16.2f} {after}")
    return "\n".join(lines)


def _output_of(prefix: str, topic: str) -> str:
    name = topic[len(prefix) + 1:]
    return "infer." if name.startswith("infer.") else name


async def _assign_outputs(consumer: AIOKafkaConsumer, prefix: str) -> None:
    """Read every partition of the layers' output topics from their ends."""
    cluster = await consumer._client.fetch_all_metadata()
    tps = [TopicPartition(topic, p) for topic in cluster.topics()
           if topic.startswith(f"{prefix}.") and _output_of(prefix, topic) in OUTPUTS
           for p in cluster.partitions_for_topic(topic) or ()]
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("-n", type=int, default=100)
    parser.add_argument("--load", type=int, default=0,
                        help="streams running beside the probes, back to back")
    parser.add_argument("--load-model", default="",
                        help="the model of those streams (default: --model)")
    args = parser.parse_args()
    asyncio.run(measure(args.prefix, args.gateway, args.model, min(args.n, 2000),
                        min(args.load, 256), args.load_model))


if __name__ == "__main__":
    main()
