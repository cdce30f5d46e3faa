"""A Kafka and a Redis of a caller's own, on free loopback ports: a
redis-server with its append-only file on (as ``infra/redis.sh`` runs it) and
a single-node KRaft broker from ``infra/kafka.sh``, which the caller may
stop, flush, restart or SIGKILL without touching the shared ones (9092,
6379) everything else uses.

Callers: the fault tests' fixtures (tests/support/services.py) and
bench/chaos.py; it lives here so that neither imports the other.
Nothing of Conveyor's product (the packages the wheel ships) imports it.

The broker gets ``CONVEYOR_HOME`` set to a folder of its own, with the jar
folder linked to the shared one (``<repository>/.conveyor/kafka/libs``), so
nothing is fetched twice. Every process starts in a session of its own, so a
signal to its group reaches the JVM behind ``kafka.sh`` too. A failed start
raises :class:`ServiceError` with the end of the service's log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Self

__all__ = ["OwnKafka", "OwnRedis", "ServiceError", "free_port", "kill_group", "port_answers",
           "redis_answers", "stop_groups"]

REPO = Path(__file__).resolve().parent.parent
KAFKA_SH = REPO / "infra" / "kafka.sh"
SHARED_JARS = REPO / ".conveyor" / "kafka" / "libs"
# the JVM flags of the brokers tests and benchmarks start, stop and restart: they
# start sooner (docs/decisions/0024-the-broker-on-two-cores.md); the shared one keeps G1
QUICK_START_JVM = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Xshare:auto"
# a cold JVM on two busy cores takes 20-40 s; the jar fetch, minutes
KAFKA_START_S = 180.0
JAR_FETCH_S = 900.0
REDIS_START_S = 15.0


class ServiceError(Exception):
    """A service of one's own did not start: the message says which and why."""


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_answers(port: int) -> bool:
    """Something listens on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def redis_answers(port: int) -> bool:
    """A Redis on 127.0.0.1:``port`` answers PING with PONG: it has loaded its files
    and runs its event loop (it listens before it loads, and may still exit then)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process group; one that is gone already is no error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(procs: Iterable[subprocess.Popen[bytes]], sig: int = signal.SIGTERM,
                grace_s: float = 10.0) -> None:
    """Signal the process group of each of ``procs`` (each started in a session of
    its own) at once, then SIGKILL what is left of each group (stragglers
    included) once its leader exited or ``grace_s`` passed."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:  # start_new_session: the group is its pid
            kill_group(proc.pid, sig)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        kill_group(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


class OwnRedis:
    """A redis-server with its append-only file on, in ``<workdir>/redis-<port>``."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Self:
        """Start (or restart, with what its files hold) and wait until it answers."""
        with (self.dir / "redis.log").open("ab") as log:
            self.popen = subprocess.Popen(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port),
                 "--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", "everysec",
                 "--save", ""],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + REDIS_START_S
        while not redis_answers(self.port):
            if time.monotonic() > deadline or self.popen.poll() is not None:
                raise ServiceError(f"redis-server on {self.port} did not start (log "
                                   f"{self.dir / 'redis.log'})")
            time.sleep(0.05)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal it and wait for it to exit (SIGKILL to its group after 20 s)."""
        if self.popen is not None:
            stop_groups([self.popen], sig, grace_s=20)
        self.popen = None

    def flush(self) -> None:
        """FLUSHALL: Redis loses every key, and keeps running."""
        subprocess.run(["redis-cli", "-p", str(self.port), "flushall"], check=True,
                       capture_output=True, timeout=10)

    def wipe(self) -> None:
        """Stop, and forget everything on disk too (a Redis that comes back empty)."""
        self.stop(signal.SIGKILL)
        for path in self.dir.rglob("*"):
            if path.is_file() and path.name != "redis.log":
                path.unlink()


class OwnKafka:
    """A single-node KRaft broker from ``infra/kafka.sh``, its files in
    ``<workdir>/kafka-<port>``."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.controller_port = free_port()
        self.home = workdir / f"kafka-{self.port}"
        (self.home / "kafka").mkdir(parents=True, exist_ok=True)
        self._groups: list[int] = []  # process groups of every kafka.sh start (the JVM's)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def link_jars(self) -> None:
        """Use the shared jar folder (fetching it once into the shared home)."""
        if not (SHARED_JARS / ".complete").exists():
            fetched = subprocess.run(["bash", str(KAFKA_SH), "fetch"], cwd=REPO,
                                     capture_output=True, timeout=JAR_FETCH_S)
            if fetched.returncode != 0:
                raise ServiceError("infra/kafka.sh fetch failed:\n" +
                                   fetched.stdout.decode(errors="replace")[-2000:] +
                                   fetched.stderr.decode(errors="replace")[-2000:])
        libs = self.home / "kafka" / "libs"
        if not libs.exists():
            libs.symlink_to(SHARED_JARS)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CONVEYOR_HOME": str(self.home), "KAFKA_PORT": str(self.port),
                "KAFKA_CONTROLLER_PORT": str(self.controller_port), "KAFKA_HEAP": "384m",
                "KAFKA_JVM_OPTS": QUICK_START_JVM}

    def start(self) -> Self:
        """Start (or restart) the broker and wait until it answers."""
        self.link_jars()
        proc = subprocess.Popen(["bash", str(KAFKA_SH), "start"], env=self._env(), cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self._groups.append(proc.pid)
        try:
            out, _ = proc.communicate(timeout=KAFKA_START_S)
        except subprocess.TimeoutExpired as exc:
            kill_group(proc.pid)
            proc.communicate()
            raise ServiceError(f"Kafka on {self.port} did not start within "
                               f"{KAFKA_START_S:.0f} s (files in {self.home})") from exc
        if proc.returncode != 0:
            raise ServiceError(f"Kafka on {self.port} did not start:\n"
                               f"{out.decode(errors='replace')[-2000:]}")
        return self

    def pid(self) -> int | None:
        """The JVM's process id, from the pid file kafka.sh writes."""
        pidfile = self.home / "kafka" / f"kafka-{self.port}.pid"
        try:
            return int(pidfile.read_text())
        except (OSError, ValueError):
            return None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the JVM (SIGTERM: a clean shutdown; SIGKILL: a crash) and wait
        until it is gone (SIGKILL after 30 s)."""
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
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """SIGKILL the JVM and every process group a start left; safe to call twice."""
        self.stop(signal.SIGKILL)
        for pgid in self._groups:
            kill_group(pgid)
