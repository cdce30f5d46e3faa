"""The compacted ``keys`` topic, the record of every API key (keyed by id) and
tenant policy (``tenant:<name>``), written whole before Redis is touched, and
the Redis copy rebuilt from it. ``{prefix}:keys:restored`` (set by a restore,
so it goes with the data) says Redis holds the whole topic; without it a miss
calls :meth:`Restorer.ensure`, which one replica runs under a lock while the
others wait; a finished restore publishes ``*``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field

from conveyor.errors import ConveyorError, SchemaError, TransientBrokerError
from conveyor.redis_clients import redis_boundary, release
from conveyor.settings import Settings
from gateway.auth.redis_copy import EVERYTHING, TENANT_PREFIX, RedisCopy
from gateway.auth.types import KeyRecord, TenantPolicy
from schemas.codec import Codec, default_codec
from topics.catalog import KEYS
from topics.clients import broker_error
from topics.follow import Record, follow
from topics.producer import Producer

__all__ = ["KeysTopic", "Restorer", "Snapshot"]

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """The newest record of every key and tenant in the topic."""

    keys: dict[str, KeyRecord] = field(default_factory=dict)
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    records_read: int = 0


class KeysTopic:
    """Writes records to the ``keys`` topic and reads it whole."""

    def __init__(self, settings: Settings, producer: Producer | None = None,
                 codec: Codec | None = None) -> None:
        self.settings = settings
        self.topic = KEYS.at(settings.kafka)
        self.producer = producer
        self.codec = codec or default_codec()

    async def write_key(self, record: KeyRecord) -> None:
        await self._send(record.id, self.codec.encode("ApiKey", record.event()))

    async def write_tenant(self, policy: TenantPolicy) -> None:
        await self._send(TENANT_PREFIX + policy.name,
                         self.codec.encode("TenantPolicy", policy.event()))

    async def _send(self, key: str, value: bytes) -> None:
        if self.producer is None:
            raise ConveyorError("this key store was built without a Kafka producer: it "
                                "can look keys up but not change them")
        try:
            await self.producer.send_and_wait(self.topic, value, key=key.encode(),
                                              partition=0)
        except Exception as exc:
            raise broker_error(exc) from exc

    async def read_all(self, timeout_s: float = 30.0) -> Snapshot:
        """Every newest record, read from the beginning to the end offset seen now;
        :class:`TransientBrokerError` when that takes longer than ``timeout_s``."""
        snapshot = Snapshot()
        follower = follow(self.settings, KEYS, 0, "beginning")

        async def read() -> None:
            async for records in follower:
                self._keep_all(snapshot, records)

        reading = asyncio.create_task(read(), name=f"read {self.topic}")
        try:
            await asyncio.wait_for(follower.caught_up.wait(), timeout_s)
        except TimeoutError as exc:
            raise TransientBrokerError(
                f"{self.topic} could not be read within {timeout_s:.0f} s") from exc
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
        return snapshot

    def _keep_all(self, snapshot: Snapshot, records: list[Record]) -> None:
        for record in records:
            snapshot.records_read += 1
            self._keep(snapshot, record.key, record.value, record.offset)

    def _keep(self, snapshot: Snapshot, key: bytes | None, value: bytes | None,
              offset: int) -> None:
        name = (key or b"").decode(errors="replace")
        try:
            if name.startswith(TENANT_PREFIX):
                policy = TenantPolicy.from_event(self.codec.decode(value, "TenantPolicy"))
                old_policy = snapshot.tenants.get(policy.name)
                if old_policy is None or policy.version >= old_policy.version:
                    snapshot.tenants[policy.name] = policy
            else:
                record = KeyRecord.from_event(self.codec.decode(value, "ApiKey"))
                old = snapshot.keys.get(record.id)
                if old is None or record.version >= old.version:
                    snapshot.keys[record.id] = record
        except SchemaError as exc:
            log.error("%s offset %d (key %r) skipped: %s", self.topic, offset, name, exc)


class Restorer:
    """Rebuilds a :class:`RedisCopy` from a :class:`KeysTopic`, one replica at a time."""

    def __init__(self, copy: RedisCopy, topic: KeysTopic, *, wait_s: float = 15.0,
                 lock_ms: int = 60_000, poll_s: float = 0.05) -> None:
        self.copy = copy
        self.topic = topic
        self.wait_s = wait_s
        self.lock_ms = lock_ms
        self.poll_s = poll_s
        self._local = asyncio.Lock()

    async def ensure(self) -> bool:
        """Restore unless Redis holds the whole topic already; True if this call did."""
        if await self.copy.is_restored():
            return False
        async with self._local:
            return await self._under_lock(only_if_missing=True) is not None

    async def restore(self) -> Snapshot:
        """Restore now, whatever the marker says (``conveyor keys restore``)."""
        async with self._local:
            snapshot = await self._under_lock(only_if_missing=False)
        assert snapshot is not None
        return snapshot

    async def _under_lock(self, only_if_missing: bool) -> Snapshot | None:
        names = self.copy.names
        token = secrets.token_hex(8)
        deadline = time.monotonic() + self.wait_s
        while True:
            if only_if_missing and await self.copy.is_restored():
                return None
            with redis_boundary("taking the restore lock"):
                taken = await self.copy.redis.set(names.restore_lock, token, nx=True,
                                                  px=self.lock_ms)
            if taken:
                break
            if time.monotonic() > deadline:
                raise TransientBrokerError(
                    f"another replica has been restoring the keys for over {self.wait_s:.0f} s")
            await asyncio.sleep(self.poll_s)
        try:
            if only_if_missing and await self.copy.is_restored():
                return None  # another replica finished just before we took the lock
            return await self._restore()
        finally:
            try:
                with redis_boundary("releasing the restore lock"):
                    await release(self.copy.redis, names.restore_lock, token)
            except TransientBrokerError as exc:  # it lapses by itself
                log.warning("restore lock not released: %s", exc)

    async def _restore(self) -> Snapshot:
        started = time.monotonic()
        snapshot = await self.topic.read_all()
        written = 0
        for policy in snapshot.tenants.values():
            written += await self.copy.put_tenant(policy)
        for record in snapshot.keys.values():
            written += await self.copy.put_key(record)
        with redis_boundary("setting the restore marker"):
            await self.copy.redis.set(self.copy.names.restored, str(int(time.time() * 1000)))
        await self.copy.publish(EVERYTHING)
        log.info("keys restored from %s: %d keys, %d tenants (%d records read, %d written "
                 "to Redis) in %.2f s", self.topic.topic, len(snapshot.keys),
                 len(snapshot.tenants), snapshot.records_read, written,
                 time.monotonic() - started)
        return snapshot
