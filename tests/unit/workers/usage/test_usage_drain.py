"""The accounting app's producer-buffer flush (workers/usage/changelog.py) on
faust's real ProducerBuffer: Faust commits a source offset right after this
flush, so it must not return while a changelog write is still buffered or
being handed to aiokafka, however slow the hand-off is."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import faust
import pytest

from conveyor.settings import load_settings
from topics.admin import Replication
from workers.usage.app import AccountingApp
from workers.usage.changelog import drain_before_commit

HAND_OFF_S = 0.25  # slower than the 0.1 s faust's own flush waits for a send


@pytest.fixture
async def buffer() -> AsyncIterator[Any]:
    app = faust.App("drain-test", broker="kafka://127.0.0.1:9092", web_enabled=False)
    buffer = app.producer.buffer
    sent: list[str] = []

    async def slow_hand_off(message: str) -> None:
        # what a first write to a changelog partition does while aiokafka
        # fetches its metadata on a busy host
        await asyncio.sleep(HAND_OFF_S)
        sent.append(message)

    buffer._send_pending = slow_hand_off
    buffer.sent = sent
    yield buffer
    # a buffer stopped with writes left says so (as faust's own does)
    with contextlib.suppress(RuntimeError):
        await buffer.stop()


async def test_flush_returns_only_when_every_buffered_write_is_handed_on(buffer: Any
                                                                         ) -> None:
    drain_before_commit(buffer, timeout_s=10)
    await buffer.start()
    for n in range(3):
        buffer.put(f"changelog-{n}")
    await buffer.flush()
    assert buffer.sent == ["changelog-0", "changelog-1", "changelog-2"]
    assert buffer.size == 0


async def test_writes_put_during_a_flush_do_not_keep_it_from_ending(buffer: Any) -> None:
    # a busy stream puts new writes all the time: the flush waits for what was
    # buffered when it began (the events its commit covers), not for a quiet moment
    drain_before_commit(buffer, timeout_s=10)
    await buffer.start()
    buffer.put("before-0")
    buffer.put("before-1")
    flush = asyncio.ensure_future(buffer.flush())
    later = 0
    while not flush.done():
        buffer.put(f"later-{later}")
        later += 1
        await asyncio.sleep(HAND_OFF_S / 4)
    await flush
    assert buffer.sent[:2] == ["before-0", "before-1"]
    assert buffer.size > 0  # what came later is still buffered


async def test_a_flush_that_cannot_finish_raises_instead_of_returning(buffer: Any) -> None:
    drain_before_commit(buffer, timeout_s=0.1)
    await buffer.start()
    buffer.put("changelog-0")
    buffer.put("changelog-1")
    with pytest.raises(TimeoutError, match="not drained"):
        await buffer.flush()


async def test_a_flush_of_a_stopped_buffer_with_writes_left_raises(buffer: Any) -> None:
    drain_before_commit(buffer, timeout_s=10)
    buffer.put("changelog-0")  # never started: nothing will hand it on
    with pytest.raises(RuntimeError, match="1 messages unsent"):
        await buffer.flush()


async def test_an_empty_buffer_flushes_at_once(buffer: Any) -> None:
    drain_before_commit(buffer, timeout_s=0.01)
    await buffer.flush()
    assert buffer.sent == []


def test_the_accounting_app_flushes_its_buffer_fully(tmp_path: Path) -> None:
    accounting = AccountingApp(load_settings(topic_prefix="drain"), Replication(1, 1, 1),
                               home=tmp_path)
    assert accounting.app.producer.buffer.flush == accounting.drain.flush
