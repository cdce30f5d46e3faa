"""The Conveyor of the chaos run, made of real processes (every layer in one,
infer workers, a gateway), each in its own process group, started, killed
and restarted by name. Its Kafka and Redis are its own, on free loopback
ports (infra/services.py's ``OwnKafka`` and ``OwnRedis``): the shared ones
(9092, 6379) are never touched.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import BenchError, Proc, repo_root
from infra.services import kill_group

__all__ = ["Conveyor"]


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
            kill_group(proc.popen.pid, sig)
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
                kill_group(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            kill_group(proc.popen.pid)  # stragglers of the group, too
            try:
                proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
