"""A Conveyor made of real processes (``conveyor layer``, ``conveyor infer``,
``conveyor gateway``) on a topic prefix of its own, for the pipeline and fault
tiers; and the topic clean-up every such test ends with."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import httpx
import openai
from aiokafka import AIOKafkaConsumer

from conveyor.settings import load_settings
from schemas.codec import default_codec
from schemas.records import WorkerHeartbeat
from tests.support.services import OwnRedis, free_port
from topics.admin import drop_topics

__all__ = ["ROOT", "TEST_MODELS", "SCRIPTED", "LLAMACPP", "Pipeline", "answers", "drop_topics"]

ROOT = Path(__file__).resolve().parents[2]
# the engines a test pipeline's workers run (``conveyor infer`` arguments). The
# scripted engine counts on from the prompt's last number until max_tokens, so
# every answer is long and shows whether a retry continued it; 20 ms a token is
# about SmolLM2's pace on this machine, which the fault tests' timings assume
# (an answer still running when a worker joins, a task still queued at a timeout)
SCRIPTED = ("--engine", "scripted", "--script", "count", "--token-delay-ms", "20")
LLAMACPP = ("--engine", "llamacpp")
TEST_MODELS = ROOT / "tests" / "data" / "models.toml"


def answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False



class Pipeline:
    """A running Conveyor made of real processes, torn down by ``close``."""

    def __init__(self, logs: Path, *, models: Path = TEST_MODELS,
                 engine: tuple[str, ...] | None = None, **env: str) -> None:
        self.prefix = f"t{uuid.uuid4().hex[:10]}"
        self.port = free_port()
        self.logs = logs
        self.env = {
            **os.environ,
            "CONVEYOR_TOPIC_PREFIX": self.prefix,
            "CONVEYOR_GATEWAY_PORT": str(self.port),
            "CONVEYOR_MODELS_FILE": str(models),
            "CONVEYOR_NO_WORKER_TIMEOUT_S": "3",
            # tasks wait in schedule for a free slot: the tests that load a worker
            # past its slots are about other things than shedding (test_admission.py)
            "CONVEYOR_SCHEDULE_TIMEOUT_S": "60",
            # the suite fills the cores on purpose: its accounting app keeps the
            # request path's priority, which its tests' bounds were measured at
            "CONVEYOR_ACCOUNTING_NICE": "0",
            **env,
        }
        self.settings = load_settings(
            topic_prefix=self.prefix, models_file=models,
            kafka_bootstrap=self.env.get("CONVEYOR_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
            redis_url=self.env.get("CONVEYOR_REDIS_URL", "redis://127.0.0.1:6379/0"),
            infer_partitions=int(self.env.get("CONVEYOR_INFER_PARTITIONS", "8")))
        # the workers' engine: the scripted one unless the test is about the
        # model's answers (``engine=LLAMACPP``); CONVEYOR_TEST_ENGINE=llamacpp
        # runs every pipeline on the real model
        if engine is None:
            engine = LLAMACPP if os.environ.get("CONVEYOR_TEST_ENGINE") == "llamacpp" \
                else SCRIPTED
        self.engine = engine
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # what each process was started with, so that heal() can start it again
        self.started_with: dict[str, tuple[tuple[str, ...], dict[str, str] | None]] = {}
        self.workers: set[str] = set()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # with CONVEYOR_AUTH=keys: the key wait_ready asks with (create_key sets it)
        self.api_key: str | None = None

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        self.started_with[name] = (args, env)
        log = open(self.logs / f"{self.prefix}-{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "cli", *args],
                                env={**self.env, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs[name] = proc
        return proc

    def start_worker(self, worker_id: str, contexts: int = 2) -> None:
        self.workers.add(worker_id)
        self.spawn(worker_id, "infer", "--pool", "cpu", *self.engine,
                   "--contexts", str(contexts), "--worker-id", worker_id)

    def cli(self, *args: str) -> str:
        """Run a ``conveyor`` command against this pipeline, in this process (a
        test about the command's process runs it as one); its stdout."""
        from cli import main as cli_main

        out, err = io.StringIO(), io.StringIO()
        with _environ(self.env), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err), \
                mock.patch.object(cli_main, "_setup_logging"):  # pytest owns the logging
            try:
                code = cli_main.main(list(args))
            except SystemExit as exc:  # argparse refused the arguments
                code = exc.code if isinstance(exc.code, int) else 2
        if code != 0:
            raise RuntimeError(f"conveyor {' '.join(args)} failed ({code}):\n{err.getvalue()}")
        return out.getvalue()

    def start_gateway(self, name: str, **env: str) -> str:
        """Another gateway replica on a port of its own; its base URL."""
        port = free_port()
        self.spawn(name, "gateway", env={"CONVEYOR_GATEWAY_PORT": str(port), **env})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited early:\n{self.tail(name)}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{name} did not become healthy:\n{self.tail(name)}")

    def start(self, workers: int = 1, contexts: int = 2) -> Pipeline:
        self.cli("topics")  # in this process: a process of its own cost a second of CPU
        self.spawn("layers", "layer")
        for i in range(workers):
            self.start_worker(f"w{i}", contexts)
        self.spawn("gateway", "gateway")
        self.wait_ready()
        if workers:
            self.wait_workers(workers)
        return self

    def wait_workers(self, n: int, timeout: float = 60.0, pool: str = "cpu") -> None:
        """Until ``n`` workers of ``pool`` heartbeat and share all its partitions
        between them: the group has settled, no rebalance is coming."""
        asyncio.run(self._wait_workers(n, within=timeout, pool=pool))

    async def _wait_workers(self, n: int, within: float, pool: str) -> None:
        codec = default_codec()
        topic = self.settings.kafka.topic("workers")
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=self.settings.kafka.bootstrap,
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        beats: dict[str, WorkerHeartbeat] = {}
        try:
            deadline = time.monotonic() + within
            while time.monotonic() < deadline:
                batch = await consumer.getmany(timeout_ms=500)
                for records in batch.values():
                    for record in records:
                        beat = codec.decode(record.value, "WorkerHeartbeat")
                        if beat["pool"] == pool:
                            beats[beat["worker_id"]] = beat
                ready = [b for b in beats.values() if b["state"] == "ready" and b["partitions"]]
                owned = [p for b in ready for p in b["partitions"]]
                if len(ready) == n and sorted(owned) == list(
                        range(self.settings.kafka.infer_partitions)):
                    return
        finally:
            await consumer.stop()
        raise RuntimeError(f"{n} workers did not settle in their group: {beats}")

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited early:\n{self.tail(name)}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1).status_code == 200:
                    # one real answer proves every layer and a worker are in place
                    auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                    r = httpx.post(f"{self.base_url}/v1/completions", timeout=60, headers=auth,
                                   json={"model": "smollm2", "prompt": "Hi", "max_tokens": 1})
                    if r.status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the pipeline did not become ready:\n" +
                           "\n".join(self.tail(n) for n in self.procs))

    def respawn(self, name: str) -> None:
        """Start ``name`` again as it was first started (a gateway on its port
        again); the dead process's log is kept beside the new one's."""
        log = self.logs / f"{self.prefix}-{name}.log"
        if log.exists():
            log.rename(log.with_suffix(f".exited-{time.monotonic_ns()}.log"))
        args, env = self.started_with[name]
        self.spawn(name, *args, env=env)

    def heal(self, redis: OwnRedis | None = None) -> list[str]:
        """Every process that exited started again (and ``redis``, the pipeline's
        own, if it is down), and the pipeline answering with all its workers in
        their group: a module's pipeline after a test that killed or stopped
        some of it. The names started again."""
        if redis is not None and not answers("127.0.0.1", redis.port):
            redis.start()
        dead = [name for name, proc in self.procs.items() if proc.poll() is not None]
        for name in dead:
            self.respawn(name)
        self.wait_ready()
        if dead and self.workers:
            self.wait_workers(len(self.workers))
        return dead

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        # a killed process with a large address space (a vLLM worker) can take
        # over 30 s to be torn down on two saturated cores
        proc.wait(timeout=120)

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{self.prefix}-{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {name}\n" + "\n".join(text.splitlines()[-lines:])

    def close(self, grace_s: float = 2.0) -> None:
        """SIGTERM every process, SIGKILL what is still running ``grace_s`` later
        (one deadline for all of them), and drop the topics. A test about how a
        process stops says so itself (and one that reads what processes write as
        they exit gives them the time); a teardown does not wait out the drain of
        processes that lost their broker (40 s each, as it once did), nor of
        workers finishing answers nobody reads (2 s, not 10: some 80 teardowns
        in a run)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        drop_topics(self.settings.kafka.bootstrap, self.prefix)


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside the block, and as it was after it."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def client(p: Pipeline, timeout: float = 120.0) -> openai.OpenAI:
    """The unmodified ``openai`` client, pointed at the pipeline's gateway."""
    return openai.OpenAI(base_url=f"{p.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=timeout)
