"""Services of a test's own, to break on purpose: a redis-server and a
single-node Kafka on free loopback ports, which a fault test may stop, restart,
flush or SIGKILL without touching the shared ones other tests use
(``own_redis``, ``own_kafka`` and ``breakable_kafka`` in tests/conftest.py
hand them out). They are infra/services.py's, beside the scripts that run
them, where the chaos benchmark finds them too."""

from __future__ import annotations

from infra.services import OwnKafka, OwnRedis, free_port

__all__ = ["OwnRedis", "OwnKafka", "free_port"]
