"""The one decode step of every reader: events typed by their topic, each
value that does not decode handed to the reader's poison handler."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiokafka import ConsumerRecord

from conveyor.errors import SchemaError
from schemas.codec import default_codec
from schemas.records import Control
from topics.catalog import CONTROL, TOKENS
from topics.reader import PoisonReport, Record, decoded


def record(offset: int, value: bytes) -> Record:
    return ConsumerRecord("t.control", 0, offset, 0, 0, b"k", value, None, 0, len(value), [])


def test_events_come_out_typed_and_poison_goes_to_the_handler(
        caplog: pytest.LogCaptureFixture) -> None:
    codec = default_codec()
    cancel: Control = {"request_id": "r", "action": "cancel", "reason": "", "ts_ms": 1}
    records = [record(0, CONTROL.encode(codec, cancel)), record(1, b"junk"),
               record(2, CONTROL.encode(codec, cancel))]
    poisoned: list[tuple[int, str]] = []

    def poison(r: Record, exc: SchemaError) -> None:
        poisoned.append((r.offset, str(exc)))

    out = decoded(CONTROL, codec, records, poison)
    assert [(r.offset, e) for r, e in out] == [(0, cancel), (2, cancel)]
    assert [o for o, _ in poisoned] == [1]
    # another topic's event is poison too: it names what was expected
    assert decoded(TOKENS, codec, records[:1], poison) == []
    assert "expected a TokenBatch" in poisoned[-1][1]

    report = PoisonReport(logging.getLogger("test.reader"), CONTROL)
    with caplog.at_level(logging.WARNING, logger="test.reader"):
        decoded(CONTROL, codec, [record(1, b"junk"), record(3, b"junk")], report)
    lines: list[Any] = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("t.control[0]@1: skipping what is not a Control")
