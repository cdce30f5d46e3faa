"""Conveyor on a three-broker Kafka cluster (infra/kafka-cluster.sh on free loopback
ports) loses one broker in the middle of streamed answers: every topic is
replicated three times with min.insync.replicas 2, so the partitions the broker
led move to the others and every answer completes, once."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from schemas.codec import default_codec
from tests.support.pipeline import ROOT, Pipeline
from tests.support.services import free_port
from topics.catalog import TOKENS
from workers.infer.progress import progress_of

PROMPT = "1, 2, 3, 4, 5,"
MAX_TOKENS = 160
STREAMS = 3


class Cluster:
    """Three KRaft nodes (broker + controller each) of infra/kafka-cluster.sh."""

    def __init__(self, home: Path) -> None:
        ports: list[int] = []
        while len(ports) < 6:
            port = free_port()
            if port not in ports:
                ports.append(port)
        self.ports, self.controller_ports = ports[:3], ports[3:]
        self.home = home
        self.env = {**os.environ, "CONVEYOR_HOME": str(home),
                    "KAFKA_CLUSTER_PORTS": " ".join(map(str, self.ports)),
                    "KAFKA_CLUSTER_CONTROLLER_PORTS": " ".join(map(str, self.controller_ports)),
                    "KAFKA_LIBS": str(ROOT / ".conveyor" / "kafka" / "libs"),
                    "KAFKA_HEAP": "384m", "KAFKA_JVM_OPTS": "-XX:TieredStopAtLevel=1"}

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> Cluster:
        subprocess.run(["bash", str(ROOT / "infra" / "kafka-cluster.sh"), "start"],
                       env=self.env, check=True, timeout=150)
        asyncio.run(self._wait_brokers(len(self.ports), within=60))
        return self

    async def _wait_brokers(self, n: int, within: float) -> None:
        """Until the cluster's metadata lists every broker (topics created before
        would be replicated less)."""
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            deadline = time.monotonic() + within
            while len((await admin.describe_cluster())["brokers"]) < n:
                assert time.monotonic() < deadline, f"{n} brokers did not register"
                await asyncio.sleep(0.5)
        finally:
            await admin.close()

    def pid(self, port: int) -> int | None:
        pidfile = self.home / "kafka-cluster" / f"node-{port}" / "kafka.pid"
        return int(pidfile.read_text()) if pidfile.exists() else None

    def kill(self, port: int) -> None:
        pid = self.pid(port)
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    def kill_all(self) -> None:
        for port in self.ports:
            self.kill(port)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    nodes = Cluster(tmp_path)
    try:
        yield nodes.start()
    finally:
        nodes.kill_all()  # every JVM, whatever happened (a half-started cluster too)


async def _topology(bootstrap: str, topics: list[str]) -> tuple[dict[int, int], dict[str, Any]]:
    """Broker id -> port, and each topic's partitions and min.insync.replicas."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        cluster = await admin.describe_cluster()
        ports = {b["node_id"]: b["port"] for b in cluster["brokers"]}
        described = await admin.describe_topics(topics)
        configs = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, t) for t in topics])
    finally:
        await admin.close()
    out: dict[str, Any] = {t["topic"]: {"partitions": t["partitions"]} for t in described}
    for response in configs:
        for resource in response.to_object()["resources"]:
            out[resource["resource_name"]]["configs"] = {
                e["config_names"]: e["config_value"] for e in resource["config_entries"]}
    return ports, out


@dataclass
class Answer:
    """One streamed answer as the client saw it."""

    request_id: str = ""
    text: str = ""
    pieces: int = 0
    finishes: list[str] = field(default_factory=list)
    dones: int = 0
    usage: dict[str, int] | None = None
    after_done: int = 0
    longest_gap_s: float = 0.0

    def counted_on(self) -> bool:
        numbers = [int(n) for n in re.findall(r"\d+", PROMPT + self.text)][:-1]
        return numbers == list(range(1, len(numbers) + 1))


def stream(base_url: str, on_piece: Callable[[int], None]) -> Answer:
    answer = Answer()
    last = time.monotonic()
    body = {"model": "smollm2", "prompt": PROMPT, "temperature": 0, "stream": True,
            "max_tokens": MAX_TOKENS, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=150,
                      headers={"X-Conveyor-Timeout": "120"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if answer.dones:
                answer.after_done += 1
            if payload == "[DONE]":
                answer.dones += 1
                continue
            event = json.loads(payload)
            assert "error" not in event, event
            answer.request_id = event["id"].removeprefix("cmpl-")
            if event.get("usage"):
                answer.usage = event["usage"]
            for choice in event["choices"]:
                assert not answer.finishes, "a piece after the final one"
                answer.text += choice["text"]
                if choice["finish_reason"] is not None:
                    answer.finishes.append(choice["finish_reason"])
                answer.pieces += 1
                now = time.monotonic()
                answer.longest_gap_s, last = max(answer.longest_gap_s, now - last), now
                on_piece(answer.pieces)
    return answer


async def _chunks(bootstrap: str, topic: str, partitions: int) -> list[Any]:
    """Every TokenChunk on ``topic`` up to its end as of now."""
    codec = default_codec()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        values: list[Any] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all([await consumer.position(tp) >= ends[tp] for tp in tps]):
                break
            for records in (await consumer.getmany(timeout_ms=500)).values():
                values.extend(c for r in records for c in TOKENS.unpack(codec, r.value))
        return values
    finally:
        await consumer.stop()


def test_a_broker_killed_mid_stream_loses_no_answer(
        cluster: Cluster, pipeline_factory: Callable[..., Pipeline]) -> None:
    p = pipeline_factory(workers=1, contexts=STREAMS, CONVEYOR_KAFKA_BOOTSTRAP=cluster.bootstrap)
    s = p.settings
    hot = [s.kafka.topic("requests"), s.kafka.topic("prepared"), s.kafka.topic("routed"),
           s.kafka.topic("tokens"),
           s.kafka.topic("replies"), s.kafka.topic("infer.cpu")]
    ports, topics = asyncio.run(_topology(cluster.bootstrap, hot))
    # the catalog was created replicated three times, min.insync.replicas 2
    for name, topic in topics.items():
        assert topic["configs"]["min.insync.replicas"] == "2", name
        assert all(len(part["replicas"]) == 3 for part in topic["partitions"]), name
    # the victim: the broker leading the most partitions of the hot path
    leads: dict[int, int] = {}
    for topic in topics.values():
        for part in topic["partitions"]:
            leads[part["leader"]] = leads.get(part["leader"], 0) + 1
    victim = max(leads, key=lambda node: leads[node])
    assert leads[victim] > 0

    started = threading.Semaphore(0)

    def on_piece(n: int) -> None:
        if n == 3:
            started.release()

    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(stream, p.base_url, on_piece) for _ in range(STREAMS)]
        for _ in range(STREAMS):
            assert started.acquire(timeout=90), "the streams did not start"
        cluster.kill(ports[victim])
        killed_at = time.monotonic()
        answers = [f.result(timeout=150) for f in futures]
    stall_s = time.monotonic() - killed_at

    chunks = asyncio.run(_chunks(s.kafka.bootstrap, s.kafka.topic("tokens"),
                                 len(topics[s.kafka.topic("tokens")]["partitions"])))
    for answer in answers:
        assert answer.dones == 1 and answer.after_done == 0, answer
        assert answer.finishes in (["length"], ["stop"]), answer
        assert answer.counted_on(), answer.text
        assert answer.usage is not None, answer
        mine = [c for c in chunks if c["envelope"]["request_id"] == answer.request_id]
        seqs = [c["seq"] for c in mine]
        assert len(seqs) == len(set(seqs)), f"{answer.request_id} was generated twice"
        logged = progress_of(mine)
        assert logged.finished and logged.text == answer.text
        assert answer.usage["completion_tokens"] == logged.tokens
        if answer.finishes == ["length"]:
            assert logged.tokens == MAX_TOKENS
    print(f"broker {victim} (led {leads[victim]} partitions) killed; the streams ended "
          f"{stall_s:.1f} s later; longest pause in a stream "
          f"{max(a.longest_gap_s for a in answers):.1f} s")
    # and the cluster of two still takes new requests
    r = httpx.post(f"{p.base_url}/v1/completions", timeout=90,
                   headers={"X-Conveyor-Timeout": "60"},
                   json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200, r.text
