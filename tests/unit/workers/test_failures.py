"""What an event a layer gave up on becomes: a dead letter and an error reply,
and no letter at all for an event of the DLQ itself (the DLQ would feed itself)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import ConsumerRecord

from conveyor.errors import SchemaError
from conveyor.settings import load_settings
from schemas.codec import default_codec
from tests.support.factories import request
from workers.failures import dead_letter, failure_outputs
from workers.outputs import Output, Sender

SETTINGS = load_settings(topic_prefix="t")


def record(topic: str) -> Any:
    return ConsumerRecord(topic=topic, partition=0, offset=5, timestamp=0, timestamp_type=0,
                          key=b"k", value=b"\x00junk", checksum=None, serialized_key_size=1,
                          serialized_value_size=5, headers=())


def sender() -> Sender:
    return Sender(SETTINGS, None, default_codec())  # type: ignore[arg-type]  # never produces


def test_an_event_of_a_layer_becomes_a_letter_and_an_error_reply() -> None:
    envelope = request()["envelope"]
    letter, reply, usage = failure_outputs(sender(), "route", record("t.prepared"), envelope,
                                           SchemaError("bad"), "SchemaError: bad")
    assert (letter.topic, letter.event_type) == ("t.dlq", "DeadLetter")
    assert letter.record["topic"] == "t.prepared" and letter.record["offset"] == 5
    assert (reply.topic, reply.event_type) == ("t.replies", "Reply")
    # the request is counted, as one that ended in an error, with the error's code
    assert (usage.topic, usage.event_type, usage.key) == ("t.usage", "UsageRecord", "default")
    assert usage.record["status"] == "error" and usage.record["completion_tokens"] == 0
    assert usage.record["error_code"] == reply.record["error"]["code"]


def test_an_event_of_the_dlq_is_passed_over_not_dead_lettered_again(
        caplog: pytest.LogCaptureFixture) -> None:
    assert failure_outputs(sender(), "jobs-dead-letters", record("t.dlq"), None,
                           SchemaError("bad"), "Traceback...\nSchemaError: bad") == []
    [line] = [r.getMessage() for r in caplog.records if r.name == "workers.failures"]
    assert line == ("jobs-dead-letters: passing over t.dlq@5, not dead-lettered again: "
                    "SchemaError: bad")


async def test_a_task_that_does_not_decode_is_dead_lettered_and_acknowledged() -> None:
    """An infer worker's poison takes the runtime's path: the letter alone (no
    request to fail), produced and acknowledged before the offset is done."""
    produced: list[list[Output]] = []

    class Acked(Sender):
        async def produce(self, outputs: list[Output],
                          stopping: asyncio.Event | None = None) -> None:
            produced.append(outputs)

    acked = Acked(SETTINGS, None, default_codec())  # type: ignore[arg-type]
    await dead_letter(acked, "infer", record("t.infer.cpu"), SchemaError("bad"))
    [[letter]] = produced
    assert (letter.topic, letter.record["layer"]) == ("t.dlq", "infer")
    assert letter.record["error"] == "SchemaError: bad"
