"""What the chaos run breaks: a redis-server and a single-node Kafka of its own
on free loopback ports, and a Conveyor made of real processes on them.

The shared Kafka (9092) and Redis (6379) are never touched: the run may stop,
flush or SIGKILL its own services at will. Kafka comes from ``infra/kafka.sh``
with ``CONVEYOR_HOME`` set to the run's folder and the jar folder linked to
the shared one, so nothing is fetched twice. Every process runs in its own
process group; :meth:`Services.close` kills them all (the JVM and redis-server
included), and is safe to call twice.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import BenchError, Proc, port_answers, repo_root

__all__ = ["ChaosKafka", "ChaosRedis", "Conveyor", "free_port", "port_answers"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ChaosRedis:
    """A redis-server with its append-only file on (as the local set-up runs it)."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        with (self.dir / "redis.log").open("ab") as log:
            self.popen = subprocess.Popen(
                ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port),
                 "--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", "everysec",
                 "--save", ""],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + 15
        while not port_answers(self.port):
            if time.monotonic() > deadline or self.popen.poll() is not None:
                raise BenchError(f"redis-server on {self.port} did not start (log {self.dir})")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _kill_group(self.popen.pid)
                self.popen.wait(timeout=5)
        self.popen = None

    def flushall(self) -> None:
        subprocess.run(["redis-cli", "-p", str(self.port), "flushall"], check=True,
                       capture_output=True, timeout=10)


class ChaosKafka:
    """A single-node KRaft broker from ``infra/kafka.sh`` on free ports."""

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
        shared = repo_root() / ".conveyor" / "kafka" / "libs"
        if not (shared / ".complete").exists():
            subprocess.run(["bash", str(repo_root() / "infra" / "kafka.sh"), "fetch"],
                           cwd=repo_root(), check=True, capture_output=True, timeout=900)
        libs = self.home / "kafka" / "libs"
        if not libs.exists():
            libs.symlink_to(shared)

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CONVEYOR_HOME": str(self.home), "KAFKA_PORT": str(self.port),
                "KAFKA_CONTROLLER_PORT": str(self.controller_port), "KAFKA_HEAP": "384m"}

    def start(self) -> None:
        """Start (or restart) the broker and wait until it answers."""
        proc = subprocess.Popen(["bash", str(repo_root() / "infra" / "kafka.sh"), "start"],
                                env=self._env(), cwd=repo_root(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self._groups.append(proc.pid)
        out, _ = proc.communicate(timeout=180)
        if proc.returncode != 0:
            raise BenchError(f"Kafka on {self.port} did not start:\n"
                             f"{out.decode(errors='replace')[-2000:]}")

    def pid(self) -> int | None:
        pidfile = self.home / "kafka" / f"kafka-{self.port}.pid"
        try:
            return int(pidfile.read_text())
        except (OSError, ValueError):
            return None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the JVM and wait until it is gone (SIGKILL after 30 s)."""
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
        os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        self.kill(signal.SIGKILL)
        for pgid in self._groups:
            _kill_group(pgid)


@dataclass
class Conveyor:
    """``conveyor layer`` (every layer), infer workers and a gateway, started and
    restarted by name; their output goes to ``<logs>/<name>.log`` (appended to on
    a restart, after a marker line)."""

    logs: Path
    env: dict[str, str]
    workers: list[str]
    contexts: int = 2
    procs: dict[str, Proc] = field(default_factory=dict)
    # exits the run did not cause: (monotonic time, name, exit code)
    unexpected: list[tuple[float, str, int]] = field(default_factory=list)
    _killed: set[str] = field(default_factory=set)

    def argv(self, name: str) -> list[str]:
        if name == "layers":
            args = ["layer"]
        elif name == "gateway":
            args = ["gateway"]
        else:
            args = ["infer", "--pool", "cpu", "--engine", "llamacpp", "--contexts",
                    str(self.contexts), "--worker-id", name]
        return [sys.executable, "-m", "cli", *args]

    def names(self) -> list[str]:
        return ["layers", *self.workers, "gateway"]

    def topics(self) -> None:
        done = subprocess.run([sys.executable, "-m", "cli", "topics"], env=self.env,
                              cwd=repo_root(), capture_output=True, timeout=120)
        if done.returncode != 0:
            raise BenchError("conveyor topics failed:\n" +
                             (done.stderr or done.stdout).decode(errors="replace")[-2000:])

    def start(self, name: str) -> None:
        log_path = self.logs / f"{name}.log"
        with log_path.open("ab") as log:
            log.write(f"\n===== chaos: start {name} at {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            popen = subprocess.Popen(self.argv(name), cwd=repo_root(), env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = Proc(name, popen, log_path)
        self._killed.discard(name)

    def start_all(self) -> None:
        for name in self.names():
            self.start(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the process group of ``name`` and wait for it to exit."""
        proc = self.procs[name]
        self._killed.add(name)
        if proc.exited() is None:
            _kill_group(proc.popen.pid, sig)
            proc.popen.wait(timeout=30)

    def restart(self, name: str) -> None:
        if self.procs[name].exited() is None:
            self.kill(name)
        self.start(name)

    def reap(self) -> list[str]:
        """The processes that exited without being killed by the run (recorded in
        ``unexpected``); the caller restarts them, as a supervisor would."""
        died = []
        for name, proc in self.procs.items():
            code = proc.exited()
            if code is not None and name not in self._killed:
                self.unexpected.append((time.monotonic(), name, code))
                self._killed.add(name)
                died.append(name)
        return died

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.exited() is None:
                _kill_group(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(proc.popen.pid)  # stragglers of the group, too
            try:
                proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
