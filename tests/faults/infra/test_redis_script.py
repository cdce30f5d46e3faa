"""infra/redis.sh runs Redis so that a crash does not forget what it held."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.support.services import free_port

ROOT = Path(__file__).resolve().parents[3]


def _cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_a_sigkilled_redis_comes_back_with_its_keys(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "CONVEYOR_HOME": str(tmp_path), "REDIS_PORT": str(port)}
    script = str(ROOT / "infra" / "redis.sh")
    subprocess.run(["bash", script, "start"], env=env, check=True, capture_output=True)
    pidfile = tmp_path / "redis" / f"redis-{port}.pid"
    try:
        assert _cli(port, "config", "get", "appendonly").split() == ["appendonly", "yes"]
        _cli(port, "set", "conveyor:claim:r1", "started:w0")
        time.sleep(1.5)  # appendfsync everysec
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        time.sleep(0.5)
        subprocess.run(["bash", script, "start"], env=env, check=True, capture_output=True)
        assert _cli(port, "get", "conveyor:claim:r1") == "started:w0"
    finally:
        subprocess.run(["bash", script, "stop"], env=env, capture_output=True)


def test_stop_leaves_a_redis_another_home_started(tmp_path: Path) -> None:
    port = free_port()
    script = str(ROOT / "infra" / "redis.sh")
    mine = {**os.environ, "CONVEYOR_HOME": str(tmp_path / "mine"), "REDIS_PORT": str(port)}
    other = {**os.environ, "CONVEYOR_HOME": str(tmp_path / "other"), "REDIS_PORT": str(port)}
    subprocess.run(["bash", script, "start"], env=mine, check=True, capture_output=True)
    try:
        said = subprocess.run(["bash", script, "start"], env=other, check=True,
                              capture_output=True, text=True).stdout
        assert "already running" in said
        subprocess.run(["bash", script, "stop"], env=other, check=True, capture_output=True)
        assert _cli(port, "ping") == "PONG"  # another clone's stop left it alone
    finally:
        subprocess.run(["bash", script, "stop"], env=mine, check=True, capture_output=True)
    assert subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                          text=True).stdout.strip() != "PONG"
