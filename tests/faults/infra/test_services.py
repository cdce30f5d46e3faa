"""infra/services.py's Redis of one's own, as the fault tests and the chaos
benchmark use it: a restart keeps what its files hold, a flush and a wipe
forget, a failed start is a ServiceError."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from infra.services import OwnRedis, ServiceError


def _cli(redis: OwnRedis, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(redis.port), *args], capture_output=True,
                          text=True, check=True, timeout=10).stdout.strip()


def test_a_redis_of_ones_own_restarts_with_its_data_and_forgets_on_a_flush_or_a_wipe(
        tmp_path: Path) -> None:
    redis = OwnRedis(tmp_path).start()
    try:
        assert redis.url == f"redis://127.0.0.1:{redis.port}/0"
        _cli(redis, "set", "a", "1")
        time.sleep(1.5)  # appendfsync everysec
        redis.stop(signal.SIGKILL)
        redis.start()
        assert _cli(redis, "get", "a") == "1"
        redis.flush()
        assert _cli(redis, "get", "a") == ""
        _cli(redis, "set", "b", "2")
        time.sleep(1.5)
        redis.wipe()
        redis.start()
        assert _cli(redis, "get", "b") == ""  # it came back empty
    finally:
        redis.stop(signal.SIGKILL)


def test_a_redis_that_cannot_start_is_a_service_error(tmp_path: Path) -> None:
    redis = OwnRedis(tmp_path)
    (redis.dir / "appendonlydir").write_text("a file where Redis wants a folder")
    with pytest.raises(ServiceError, match=f"redis-server on {redis.port} did not start"):
        redis.start()
    redis.stop(signal.SIGKILL)
