"""A follower decodes as its typed topic's event type: poison is logged and
skipped, ``keep`` chooses what is decoded, and a batch is handed on even when
nothing of it was kept."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest

from conveyor.settings import Settings
from schemas.codec import default_codec
from schemas.records import Control
from topics.admin import ensure_topics
from topics.catalog import CONTROL, KEYS, catalog
from topics.clients import make_producer
from topics.follow import follow


async def test_events_skip_poison_and_keep_what_is_asked(
        services: None, caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    await ensure_topics(settings, [s for s in catalog(settings) if s.name == CONTROL.at(settings)])
    codec = default_codec()
    producer = make_producer(settings)
    await producer.start()
    try:
        for value, key in [(codec.encode("Control", Control(request_id="a", action="cancel",
                                                            ts_ms=1)), b"a"),
                           (b"not an event", b"b"),
                           (codec.encode("Control", Control(request_id="c", action="cancel",
                                                            ts_ms=2)), b"c")]:
            await producer.send_and_wait(CONTROL.at(settings), value, key=key)
    finally:
        await producer.stop()

    async def read(**kw: Any) -> list[str]:
        follower = follow(settings, CONTROL, 0, "beginning")
        seen: list[str] = []
        async for batch in follower.events(codec, **kw):
            seen += [event["request_id"] for _, event in batch]
            if follower.position == 3:  # all three records read
                return seen
        return seen

    with caplog.at_level(logging.WARNING, logger="topics.follow"):
        assert await asyncio.wait_for(read(), 30) == ["a", "c"]
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1
    assert skipped[0].startswith(f"{CONTROL.at(settings)}[0]@1: skipping what is not a Control")
    assert await asyncio.wait_for(read(keep=lambda r: r.key == b"c"), 30) == ["c"]


async def test_a_topic_of_two_event_types_has_no_single_decoding() -> None:
    follower = follow(Settings(topic_prefix="t"), KEYS)
    with pytest.raises(TypeError, match="one event type"):
        await follower.events(default_codec()).__anext__()
