"""Rebuilding the Redis copy from the ``keys`` topic after Redis lost its data.

The marker ``{prefix}:keys:restored`` (set only by a restore, so it goes with
the data) says Redis holds the whole topic; a lookup that misses without it
calls :meth:`Restorer.ensure` and looks again. One replica restores under the
lock ``{prefix}:keys:restore-lock`` (``SET NX PX``); the others wait for the
marker up to ``wait_s``, then raise
:class:`~conveyor.errors.TransientBrokerError`. Writes are version-guarded, and
a finished restore publishes ``*`` so cached "unknown key" answers go."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from conveyor.errors import TransientBrokerError
from conveyor.redis_clients import redis_boundary
from gateway.auth.keys_topic import KeysTopic, Snapshot
from gateway.auth.redis_copy import EVERYTHING, RedisCopy

__all__ = ["Restorer"]

log = logging.getLogger(__name__)

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


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
        self._release = copy.redis.register_script(_RELEASE)

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
                    await self._release(keys=[names.restore_lock], args=[token])
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
