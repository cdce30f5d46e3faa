"""What an event a layer gave up on becomes: a dead letter on ``conveyor.dlq``
(the original bytes and the error) and, when the event belongs to a request,
the error reply that fails it. An event read from the DLQ itself gets no
letter (the DLQ would feed itself): it is logged and passed over.
"""

from __future__ import annotations

import asyncio
import logging

from conveyor.errors import PermanentBrokerError, SchemaError, last_line
from schemas.records import Envelope
from workers.layer import Record
from workers.outputs import Output, Sender, failure_reply

__all__ = ["dead_letter", "failure_outputs"]

log = logging.getLogger(__name__)


def failure_outputs(sender: Sender, layer: str, record: Record, envelope: Envelope | None,
                    exc: BaseException, detail: str) -> list[Output]:
    """The dead letter (none for an event of the DLQ) and the error reply (none
    without a request, or one without a reply address) of ``record``."""
    outputs: list[Output] = []
    letter = sender.letter_output(layer, record.topic, record.partition, record.offset,
                                  record.key, record.value, detail)
    if letter.topic == record.topic:
        log.error("%s: passing over %s@%d, not dead-lettered again: %s", layer, record.topic,
                  record.offset, last_line(detail))
    else:
        outputs.append(letter)
    if envelope is not None:
        outputs.extend(sender.error_outputs(envelope, failure_reply(exc, layer)))
    return outputs


async def dead_letter(sender: Sender, layer: str, record: Record, exc: BaseException,
                      stopping: asyncio.Event | None = None) -> None:
    """Dead-letter ``record`` (an event that does not decode: no request to
    fail) and wait for the broker to have the letter; one that can never be
    produced is logged. TransientBrokerError: ``stopping`` was set while the
    broker did not take it (the event stays uncommitted)."""
    outputs = failure_outputs(sender, layer, record, None, exc, f"{type(exc).__name__}: {exc}")
    try:
        await sender.produce(outputs, stopping)
    except (PermanentBrokerError, SchemaError) as again:
        log.error("%s: cannot dead-letter %s@%d: %s", layer, record.topic, record.offset, again)
