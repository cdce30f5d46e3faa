"""infra/services.py's Redis of one's own, as the fault tests and the chaos
benchmark use it: a restart keeps what its files hold, a flush and a wipe
forget, a failed start is a ServiceError."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from infra.services import OwnRedis, ServiceError, port_answers, redis_answers


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


def test_a_redis_that_listens_but_is_still_loading_is_not_ready() -> None:
    """Redis binds its port before it loads its files and may exit after that (a
    bad append-only dir): a port that answers is not a Redis that does."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def loading() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"-LOADING Redis is loading the dataset in memory\r\n")

        thread = threading.Thread(target=loading, daemon=True)
        thread.start()
        assert not redis_answers(port)
        thread.join(5)
        assert port_answers(port)
