"""A process that cannot start says what it waited for, and exits (code 3) after
``CONVEYOR_STARTUP_TIMEOUT_S`` instead of sitting silent.

bench.chaos once saw two infer workers sit four minutes in their consumer
group's join without a line (conveyor/startup.py). Here a broker that is not
there, a Redis that is not there, and a group join that cannot finish (a
member frozen with SIGSTOP, which the broker waits for) each end the process
with the reason, the address and no traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.support.pipeline import ROOT, TEST_MODELS, drop_topics

SCRIPTED = ["infer", "--engine", "scripted", "--script", "count"]


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def conveyor_env(prefix: str, **env: str) -> dict[str, str]:
    return {**os.environ, "CONVEYOR_TOPIC_PREFIX": prefix,
            "CONVEYOR_MODELS_FILE": str(TEST_MODELS), "CONVEYOR_STARTUP_TIMEOUT_S": "4",
            **env}


def run_to_exit(argv: list[str], env: dict[str, str], within: float = 120.0
                ) -> tuple[int, str]:
    """Run ``conveyor *argv`` until it exits by itself (killed after ``within``)."""
    done = subprocess.run([sys.executable, "-m", "cli", *argv], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=within)
    return done.returncode, done.stdout


def assert_gave_up(rc: int, out: str, *phrases: str) -> None:
    assert rc == 3, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("conveyor ") and "gave up after " in last, out
    for phrase in phrases:
        assert phrase in last, out
    assert "waiting for" in out and "so far" in out, out  # said while it waited
    assert "Traceback" not in out, out


def test_a_layer_process_without_kafka_names_the_broker() -> None:
    port = dead_port()
    env = conveyor_env(f"t{uuid.uuid4().hex[:10]}",
                       CONVEYOR_KAFKA_BOOTSTRAP=f"127.0.0.1:{port}")
    rc, out = run_to_exit(["layer"], env)
    assert_gave_up(rc, out, "waiting for the broker", f"Kafka at 127.0.0.1:{port}")


def test_an_infer_worker_without_redis_names_it_without_its_password(services: None) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    port = dead_port()
    env = conveyor_env(prefix, CONVEYOR_REDIS_URL=f"redis://:s3cret@127.0.0.1:{port}/0")
    try:
        rc, out = run_to_exit(SCRIPTED, env)
    finally:
        drop_topics("127.0.0.1:9092", prefix)
    assert_gave_up(rc, out, "waiting for Redis", f"Redis at 127.0.0.1:{port}/0",
                   "Connection refused")
    assert "s3cret" not in out


def wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes],
                  within: float = 90.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        assert proc.poll() is None, log.read_text(errors="replace")
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} within {within} s:\n{log.read_text(errors='replace')}")


def test_a_group_join_that_cannot_finish_is_named(services: None, tmp_path: Path) -> None:
    """The first worker joins with a 60 s session and rebalance timeout, then is
    frozen: the broker holds the second worker's join until it rejoins or its
    session ends, a minute later. The second gives up at its bound, saying so."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    log = tmp_path / "frozen.log"
    with log.open("wb") as out:
        frozen = subprocess.Popen(
            [sys.executable, "-m", "cli", *SCRIPTED, "--worker-id", "frozen"],
            env=conveyor_env(prefix, CONVEYOR_INFER_SESSION_TIMEOUT_MS="60000",
                             CONVEYOR_INFER_HEARTBEAT_INTERVAL_MS="1000"),
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_line(log, "worker frozen: serving pool cpu", frozen)
        frozen.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        rc, out_text = run_to_exit([*SCRIPTED, "--worker-id", "second"], conveyor_env(prefix))
        assert time.monotonic() - started < 50  # well before the frozen session ends
    finally:
        frozen.kill()
        frozen.wait(timeout=30)
        drop_topics("127.0.0.1:9092", prefix)
    assert_gave_up(rc, out_text, f"consumer group {prefix}.infer.cpu",
                   f"partitions of {prefix}.infer.cpu", "Kafka at 127.0.0.1:9092")
