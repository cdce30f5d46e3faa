"""The live model registry: ``conveyor models apply`` publishes a registry
file to ``conveyor.models`` (compacted, one record); every process that serves
by it reads it at start (:func:`adopt_published`, winning over its file) and
follows it, swapping its :class:`~conveyor.registry.Registry` in place. A bad
record is logged and passed over. What changes live:
docs/operating/registry.md#changing-it-live.
"""

from __future__ import annotations

import asyncio
import getpass
import hashlib
import logging
import socket
from typing import TypeVar

from conveyor.errors import ConveyorError
from conveyor.registry import Registry
from conveyor.settings import Settings
from schemas.codec import default_codec
from schemas.records import ModelRegistry
from topics.catalog import MODELS, Topic
from topics.envelope import now_ms
from topics.follow import apply_all, follow, snapshot

__all__ = ["adopt_published", "follow_published", "operator", "publish", "publish_one",
           "published", "record_of"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_KEY = b"registry"


def record_of(text: str, source: str) -> ModelRegistry:
    """The event that publishes ``text``, once it parses as a registry (a bad
    file is refused whole: ConveyorError naming the model and the field)."""
    Registry.parse(text, source)
    return ModelRegistry(text=text, digest=hashlib.sha256(text.encode()).hexdigest()[:12],
                         source=source, applied_by=operator(), ts_ms=now_ms())


def operator() -> str:
    """Who runs this command: user@host (the host alone where the user has no name)."""
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except (OSError, KeyError):
        return socket.gethostname()


async def publish(settings: Settings, record: ModelRegistry) -> None:
    """Write ``record`` to ``conveyor.models`` and wait for the broker to have it."""
    await publish_one(settings, MODELS, record, _KEY)


async def publish_one(settings: Settings, topic: Topic[T], event: T, key: bytes) -> None:
    """Write one event (a command's: a registry, a policy) and wait for the broker
    to have it."""
    from topics.clients import make_producer

    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(topic.at(settings.kafka),
                                     topic.encode(default_codec(), event), key=key)
    finally:
        await producer.stop()


async def published(settings: Settings, within_s: float) -> ModelRegistry | None:
    """The registry applied last, or None when none ever was."""
    latest: list[ModelRegistry] = []
    await snapshot(follow(settings, MODELS, 0, "beginning"), default_codec(), latest.append,
                   within_s)
    return latest[-1] if latest else None


async def adopt_published(settings: Settings, registry: Registry) -> ModelRegistry | None:
    """Serve by the registry applied last, if one was; the record adopted. (The
    caller bounds the wait by the start-up timeout, and says what it waits for.)"""
    record = await published(settings, 2 * settings.process.startup_timeout_s)
    if record is not None:
        _adopt(registry, record)
    return record


async def follow_published(settings: Settings, registry: Registry,
                           ready: asyncio.Event | None = None) -> None:
    """Swap ``registry`` for each registry applied from now on (and the last one
    before, again), for ever: a process's background task."""
    await apply_all(follow(settings, MODELS, 0, "beginning"), default_codec(),
                    lambda record: _adopt(registry, record),
                    None if ready is None else ready.set)


def _adopt(registry: Registry, record: ModelRegistry) -> None:
    if registry.digest == record["digest"]:
        return
    try:
        applied = Registry.parse(record["text"], f"the registry applied from {record['source']}")
    except ConveyorError as exc:
        log.error("models: keeping the registry in use: %s", exc)
        return
    registry.replace(applied, record["digest"])
    log.info("models: serving the registry %s applied by %s from %s (%d models)",
             record["digest"], record["applied_by"], record["source"], len(applied.models))
