"""``conveyor up`` supervises its processes: a child that dies is started again
(and the log says which one and why), one that keeps dying makes it give up,
and SIGTERM stops everything. Run for real against the shared Kafka and Redis
on a topic prefix of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.pipeline import ROOT, TEST_MODELS, drop_topics
from tests.support.services import free_port


def _children(pid: int) -> dict[int, str]:
    """The live processes whose parent is ``pid``, with their command lines."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found[int(entry.name)] = cmdline
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Up:
    """One ``conveyor up --no-infra`` with its output in a file."""

    def __init__(self, logs: Path) -> None:
        self.port = free_port()
        self.log = logs / "up.log"
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "CONVEYOR_TOPIC_PREFIX": f"t{uuid.uuid4().hex[:10]}",
                    "CONVEYOR_GATEWAY_PORT": str(self.port),
                    "CONVEYOR_MODELS_FILE": str(TEST_MODELS),
                    "CONVEYOR_NO_WORKER_TIMEOUT_S": "5"}
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: set[int] = set()

    def start(self, *args: str) -> Up:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli", "up", "--no-infra", *args],
                env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def children(self) -> dict[int, str]:
        found = _children(self.pid)
        self.seen.update(found)
        return found

    def infer_pids(self) -> list[int]:
        """The generating workers (not the embedding pool's encoder workers)."""
        return [pid for pid, cmd in self.children().items()
                if " infer " in cmd and "--engine encoder" not in cmd]

    def complete(self, timeout: float) -> httpx.Response:
        """A completion answered 200 within ``timeout`` (retrying while it starts)."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.text()[-3000:]
            try:
                r = httpx.post(f"{self.base_url}/v1/completions", timeout=60,
                               headers={"X-Conveyor-Timeout": "30"},
                               json={"model": "smollm2", "prompt": "Hi", "max_tokens": 4})
                if r.status_code == 200:
                    return r
                last = r.text
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(1)
        raise AssertionError(f"no answer within {timeout} s ({last!r}):\n{self.text()[-3000:]}")

    def wait_log(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            assert time.monotonic() < deadline, f"{needle!r} not logged:\n{self.text()[-3000:]}"
            time.sleep(0.2)

    def close(self) -> None:
        self.children()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.seen:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        # the topics conveyor up made (in its own processes: the test's session never
        # hears of this prefix, so nothing else drops them)
        drop_topics(os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
                    self.env["CONVEYOR_TOPIC_PREFIX"])


@pytest.fixture
def up(services: None, tmp_path: Path) -> Iterator[Up]:
    running = Up(tmp_path)
    try:
        yield running
    finally:
        running.close()


def test_a_killed_infer_worker_is_restarted_and_the_pipeline_serves_again(up: Up) -> None:
    up.start("--workers", "1", "--contexts", "1")
    up.complete(timeout=150)
    [old] = up.infer_pids()
    others = set(up.children()) - {old}
    os.kill(old, signal.SIGKILL)
    up.wait_log(f"infer cpu-0 (pid {old}) was killed by SIGKILL", timeout=30)
    deadline = time.monotonic() + 60
    while not [p for p in up.infer_pids() if p != old]:
        assert time.monotonic() < deadline, up.text()[-3000:]
        time.sleep(0.2)
    assert others <= set(up.children()), "a child that did not die was restarted"
    assert up.complete(timeout=150).json()["choices"][0]["text"]
    # and SIGTERM still stops everything, cleanly
    children = set(up.children())
    up.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert up.proc.wait(timeout=90) == 0  # type: ignore[union-attr]
    assert not [pid for pid in children if _alive(pid)]


def test_a_child_that_keeps_dying_at_once_makes_up_give_up(up: Up) -> None:
    # an openai engine without --upstream exits with code 1 as soon as it starts
    up.start("--engine", "openai", "--restart-limit", "3")
    assert up.proc is not None
    deadline = time.monotonic() + 150
    while up.proc.poll() is None:
        up.children()
        assert time.monotonic() < deadline, up.text()[-3000:]
        time.sleep(0.2)
    text = up.text()
    assert up.proc.returncode == 1, text[-3000:]
    assert "exited with code 1" in text and "restarting it in 1 s" in text
    assert "restarting it in 2 s" in text
    assert "3 times in a row" in text and "giving up" in text
    # the reason, from the child's stderr, is in the supervisor's line
    gave_up = text[text.index("giving up"):]
    assert "its last stderr lines:" in gave_up
    assert "    --engine openai needs --upstream URL" in gave_up
    assert not [pid for pid in up.seen if _alive(pid)]
