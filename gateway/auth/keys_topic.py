"""The ``keys`` topic: the record of every API key and tenant policy.

Compacted, one partition. Each change writes the whole record (acks=all)
before Redis is touched. A key's record is keyed by its id (``ApiKey``), a
tenant's by ``tenant:<name>`` (``TenantPolicy``); nothing is deleted (a revoked
key keeps ``revoked_ms``). :meth:`KeysTopic.read_all` reads to the end offset
seen at its start with the shared follower (topics/follow.py), keeps the
highest version per id, skips a value that does not decode, and raises
:class:`~conveyor.errors.TransientBrokerError` past ``timeout_s``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from conveyor.errors import ConveyorError, SchemaError, TransientBrokerError
from conveyor.settings import Settings
from gateway.auth.redis_copy import TENANT_PREFIX
from gateway.auth.types import KeyRecord, Limits, TenantPolicy
from schemas.codec import Codec, default_codec
from schemas.records import ApiKey
from schemas.records import TenantPolicy as TenantPolicyEvent
from topics.catalog import KEYS
from topics.clients import broker_error
from topics.follow import Record, follow
from topics.producer import EventProducer

__all__ = ["KeysTopic", "Snapshot", "key_event", "key_from_event", "tenant_event",
           "tenant_from_event"]

log = logging.getLogger(__name__)


def key_event(record: KeyRecord) -> ApiKey:
    return ApiKey(id=record.id, tenant=record.tenant, name=record.name, hash=record.hash,
                  rpm=record.limits.rpm, tpm=record.limits.tpm,
                  concurrency=record.limits.concurrency, models=list(record.models),
                  created_ms=record.created_ms, expires_ms=record.expires_ms,
                  revoked_ms=record.revoked_ms, version=record.version)


def key_from_event(event: ApiKey) -> KeyRecord:
    return KeyRecord(id=event["id"], tenant=event["tenant"], name=event["name"],
                     hash=event["hash"],
                     limits=Limits(rpm=event["rpm"], tpm=event["tpm"],
                                   concurrency=event["concurrency"]),
                     models=tuple(event["models"]), created_ms=event["created_ms"],
                     expires_ms=event["expires_ms"], revoked_ms=event["revoked_ms"],
                     version=event["version"])


def tenant_event(policy: TenantPolicy) -> TenantPolicyEvent:
    return TenantPolicyEvent(name=policy.name, rpm=policy.limits.rpm, tpm=policy.limits.tpm,
                             concurrency=policy.limits.concurrency,
                             daily_tokens=policy.daily_tokens,
                             monthly_tokens=policy.monthly_tokens, version=policy.version)


def tenant_from_event(event: TenantPolicyEvent) -> TenantPolicy:
    return TenantPolicy(name=event["name"],
                        limits=Limits(rpm=event["rpm"], tpm=event["tpm"],
                                      concurrency=event["concurrency"]),
                        daily_tokens=event["daily_tokens"],
                        monthly_tokens=event["monthly_tokens"], version=event["version"])


@dataclass
class Snapshot:
    """The newest record of every key and tenant in the topic."""

    keys: dict[str, KeyRecord] = field(default_factory=dict)
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    records_read: int = 0


class KeysTopic:
    """Writes records to the ``keys`` topic and reads it whole."""

    def __init__(self, settings: Settings, producer: EventProducer | None = None,
                 codec: Codec | None = None) -> None:
        self.settings = settings
        self.topic = KEYS.at(settings.kafka)
        self.producer = producer
        self.codec = codec or default_codec()

    async def write_key(self, record: KeyRecord) -> None:
        await self._send(record.id, self.codec.encode("ApiKey", key_event(record)))

    async def write_tenant(self, policy: TenantPolicy) -> None:
        await self._send(TENANT_PREFIX + policy.name,
                         self.codec.encode("TenantPolicy", tenant_event(policy)))

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
                policy = tenant_from_event(self.codec.decode(value, "TenantPolicy"))
                old_policy = snapshot.tenants.get(policy.name)
                if old_policy is None or policy.version >= old_policy.version:
                    snapshot.tenants[policy.name] = policy
            else:
                record = key_from_event(self.codec.decode(value, "ApiKey"))
                old = snapshot.keys.get(record.id)
                if old is None or record.version >= old.version:
                    snapshot.keys[record.id] = record
        except SchemaError as exc:
            log.error("%s offset %d (key %r) skipped: %s", self.topic, offset, name, exc)
