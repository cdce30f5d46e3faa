"""Services of a test's own, to break on purpose: a redis-server and a
single-node Kafka on free loopback ports, which a fault test may stop, restart,
flush or SIGKILL without touching the shared ones other tests use. They are
the chaos benchmark's (``bench/chaos_services.py``), with the shape the
fixtures hand out."""

from __future__ import annotations

import signal
from pathlib import Path

from bench.chaos_services import ChaosKafka, ChaosRedis, free_port

__all__ = ["OwnRedis", "OwnKafka", "free_port"]


class OwnRedis(ChaosRedis):
    """A redis-server with its append-only file on, as infra/redis.sh runs it."""

    def start(self) -> OwnRedis:  # type: ignore[override]
        super().start()
        return self

    def flush(self) -> None:
        self.flushall()

    def wipe(self) -> None:
        """Stop, and forget everything on disk too (a Redis that comes back empty)."""
        self.stop(signal.SIGKILL)
        for path in self.dir.rglob("*"):
            if path.is_file() and path.name != "redis.log":
                path.unlink()


class OwnKafka(ChaosKafka):
    """A single-node KRaft broker from infra/kafka.sh on free ports."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.link_jars()

    def start(self) -> OwnKafka:  # type: ignore[override]
        super().start()
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.kill(sig)
