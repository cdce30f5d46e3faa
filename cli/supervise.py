"""Keeping ``conveyor up``'s processes running: a child that dies is started
again with a backoff, and its death is told (see :class:`Supervisor`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from topics.backoff import Backoff

__all__ = ["Child", "Supervisor"]

_STDERR_TAIL_LINES = 8
log = logging.getLogger("conveyor")


class Child:
    """One supervised process of ``conveyor up``: its command, its current process, and
    the count of quick deaths in a row that sets its backoff."""

    def __init__(self, name: str, command: list[str]) -> None:
        self.name = name
        self.command = command
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.restart_at = 0.0
        self.quick_deaths = 0
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self._pump: threading.Thread | None = None

    def start(self) -> int:
        self.stderr_tail.clear()
        self.proc = proc = subprocess.Popen(self.command, env=os.environ.copy(),
                                            stderr=subprocess.PIPE)
        self.started = time.monotonic()
        self._pump = threading.Thread(target=self._forward_stderr, args=(proc,),
                                      name=f"stderr-{self.name}", daemon=True)
        self._pump.start()
        return proc.pid

    def _forward_stderr(self, proc: subprocess.Popen[bytes]) -> None:
        """Copy the child's stderr to ours as it comes (one write for what one read
        brought, not one a line), keeping its last lines."""
        assert proc.stderr is not None
        out = getattr(sys.stderr, "buffer", None)
        partial = b""
        fd = proc.stderr.fileno()
        while chunk := os.read(fd, 1 << 16):
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stderr.write(chunk.decode(errors="replace"))
            *lines, partial = (partial + chunk).split(b"\n")
            self.stderr_tail.extend(line.decode(errors="replace").rstrip()
                                    for line in lines[-_STDERR_TAIL_LINES:])
            partial = partial[-(1 << 16):]  # a line without an end is kept bounded
        if partial:
            self.stderr_tail.append(partial.decode(errors="replace").rstrip())

    def reap(self) -> str:
        """Why the child ended (its stderr read to the end): an exit code or a signal."""
        if self._pump is not None:
            self._pump.join(timeout=2)
        assert self.proc is not None and self.proc.returncode is not None
        code = self.proc.returncode
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._pump is not None:
            self._pump.join(timeout=2)


class Supervisor:
    """Keeps ``conveyor up``'s processes running: a child that dies is started
    again after a backoff doubling from 1 s to 30 s while it dies within 60 s of
    its start; ``restart_limit`` such deaths in a row stop everything (exit 1).
    SIGINT and SIGTERM stop every child, gateway first (exit 0). For operators:
    docs/operating/processes.md.
    """

    backoff_first_s = 1.0
    backoff_max_s = 30.0
    healthy_after_s = 60.0

    def __init__(self, children: list[Child], restart_limit: int) -> None:
        self.children = children
        self.restart_limit = max(1, restart_limit)
        self.stopping = False

    def stop(self, *_: object) -> None:
        self.stopping = True

    def run(self) -> int:
        for child in self.children:
            child.start()
        code = 0
        while not self.stopping and code == 0:
            now = time.monotonic()
            for child in self.children:
                if child.proc is None:
                    if now >= child.restart_at:
                        log.info("started %s again (pid %d)", child.name, child.start())
                elif child.proc.poll() is not None and not self.stopping:
                    code = self._on_death(child, now)
                    if code:
                        break
            time.sleep(0.2)
        for child in reversed(self.children):
            child.stop()
        for child in reversed(self.children):
            child.wait(timeout=40)
        return code

    def _on_death(self, child: Child, now: float) -> int:
        assert child.proc is not None
        why, pid, ran = child.reap(), child.proc.pid, now - child.started
        tail = "".join(f"\n    {line}" for line in child.stderr_tail)
        tail = f"; its last stderr lines:{tail}" if tail else ""
        child.quick_deaths = child.quick_deaths + 1 if ran < self.healthy_after_s else 1
        if child.quick_deaths >= self.restart_limit:
            log.error(f"{child.name} (pid {pid}) {why} after {ran:.1f} s, {child.quick_deaths} "
                      f"times in a row within {self.healthy_after_s:.0f} s of its start: "
                      f"giving up, stopping everything{tail}")
            return 1
        # without jitter: one supervisor restarts its own children
        delay = Backoff(self.backoff_first_s, self.backoff_max_s,
                        attempts=child.quick_deaths - 1, rand=lambda: 1.0).next_delay()
        # formatted here, not by logging: the repeat filter holds back records of one
        # template, and every death must be told
        log.error(f"{child.name} (pid {pid}) {why} after {ran:.1f} s; "
                  f"restarting it in {delay:.0f} s{tail}")
        child.proc, child.restart_at = None, now + delay
        return 0
