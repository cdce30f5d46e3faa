"""Services of a test's own, to break on purpose: a redis-server and a
single-node Kafka on free loopback ports, which a fault test may stop, restart,
flush or SIGKILL without touching the shared ones other tests use."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["OwnRedis", "OwnKafka", "free_port"]

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class OwnRedis:
    """A redis-server with its append-only file on, as infra/redis.sh runs it."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> OwnRedis:
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir",
             str(self.dir), "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not _answers(self.port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"redis on {self.port} did not start")
            time.sleep(0.05)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=20)
        self.proc = None

    def flush(self) -> None:
        subprocess.run(["redis-cli", "-p", str(self.port), "flushall"], check=True,
                       capture_output=True)

    def wipe(self) -> None:
        """Stop, and forget everything on disk too (a Redis that comes back empty)."""
        self.stop(signal.SIGKILL)
        for path in self.dir.rglob("*"):
            if path.is_file() and path.name != "redis.log":
                path.unlink()


class OwnKafka:
    """A single-node KRaft broker from infra/kafka.sh on free ports."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.controller_port = free_port()
        self.home = workdir / f"kafka-{self.port}"
        self.home.mkdir(parents=True, exist_ok=True)
        shared = ROOT / ".conveyor" / "kafka" / "libs"
        (self.home / "kafka").mkdir(exist_ok=True)
        libs = self.home / "kafka" / "libs"
        if shared.is_dir() and not libs.exists():
            libs.symlink_to(shared)  # the jars are fetched once, into the shared home

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CONVEYOR_HOME": str(self.home), "KAFKA_PORT": str(self.port),
                "KAFKA_CONTROLLER_PORT": str(self.controller_port), "KAFKA_HEAP": "384m"}

    def start(self) -> OwnKafka:
        subprocess.run(["bash", str(ROOT / "infra" / "kafka.sh"), "start"], env=self._env(),
                       check=True, capture_output=True)
        return self

    def pid(self) -> int | None:
        pidfile = self.home / "kafka" / f"kafka-{self.port}.pid"
        return int(pidfile.read_text()) if pidfile.exists() else None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        pid = self.pid()
        if pid is None:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
