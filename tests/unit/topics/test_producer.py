"""The producer that outlives a broken idempotent session (topics/producer.py),
on a fake aiokafka producer at the seam; tests/kafka/topics/test_producer.py
breaks a real one's sequence on the real broker."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import errors as kafka_errors

from conveyor.errors import TransientBrokerError
from topics.clients import broker_error
from topics.producer import Producer, breaks_sequence


@dataclass
class FakeKafkaProducer:
    """AIOKafkaProducer's send at the seam: each record is acknowledged on the
    next turn of the loop, or, from the ``refuse_from``-th on, refused with
    ``refusal`` as a broker refuses a batch whose sequence has a hole. ``dead``:
    its sender routine died of ``refusal``, so send itself raises it."""

    name: str
    refuse_from: int | None = None
    refusal: type[Exception] = kafka_errors.OutOfOrderSequenceNumber
    dead: bool = False
    start_error: Exception | None = None
    attempts: list[bytes | None] = field(default_factory=list)
    written: list[bytes | None] = field(default_factory=list)
    started: bool = False
    stopped: bool = False

    def __post_init__(self) -> None:
        task: asyncio.Future[None] | None = None
        if self.dead:
            task = asyncio.get_running_loop().create_future()
            task.set_exception(self.refusal())
            task.exception()
        self._sender = SimpleNamespace(sender_task=task)

    async def start(self) -> None:
        if self.start_error is not None:
            raise self.start_error
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def flush(self) -> None:
        await asyncio.sleep(0)

    async def partitions_for(self, topic: str) -> set[int]:
        return {0, 1}

    async def send(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                   partition: int | None = None, timestamp_ms: int | None = None,
                   headers: Any = None) -> asyncio.Future[Any]:
        if self.dead:
            raise self.refusal()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self.attempts.append(value)
        if self.refuse_from is not None and len(self.attempts) > self.refuse_from:
            loop.call_soon(fut.set_exception, self.refusal())
        else:
            self.written.append(value)
            loop.call_soon(fut.set_result, (self.name, len(self.written) - 1))
        return fut


def producer_over(*fakes: FakeKafkaProducer) -> Producer:
    queue = list(fakes)
    return Producer(lambda: queue.pop(0))  # type: ignore[arg-type,return-value]


async def test_a_record_refused_for_its_sequence_goes_through_on_a_fresh_producer() -> None:
    broken = FakeKafkaProducer("old", refuse_from=2)
    fresh = FakeKafkaProducer("new")
    producer = producer_over(broken, fresh)
    await producer.start()
    acks = [await producer.send("t", f"m{i}".encode(), key=b"r1") for i in range(4)]
    assert await asyncio.gather(*acks) == [("old", 0), ("old", 1), ("new", 0), ("new", 1)]
    assert broken.written == [b"m0", b"m1"] and fresh.written == [b"m2", b"m3"]
    assert producer.renewals == 1
    await asyncio.sleep(0)
    assert broken.stopped and fresh.started and not fresh.stopped
    assert await producer.send_and_wait("t", b"m4") == ("new", 2)  # the fresh one stays


@pytest.mark.parametrize("refusal", [kafka_errors.OutOfOrderSequenceNumber,
                                     kafka_errors.UnknownProducerId,
                                     kafka_errors.ProducerFenced])
async def test_every_refusal_of_the_producer_id_or_sequence_renews_it(
        refusal: type[Exception]) -> None:
    producer = producer_over(FakeKafkaProducer("old", refuse_from=0, refusal=refusal),
                             FakeKafkaProducer("new"))
    await producer.start()
    assert await producer.send_and_wait("t", b"m0") == ("new", 0)


async def test_a_producer_whose_sender_died_is_replaced() -> None:
    dead = FakeKafkaProducer("old", dead=True)
    producer = producer_over(dead, FakeKafkaProducer("new"))
    await producer.start()
    assert await producer.send_and_wait("t", b"m0") == ("new", 0)
    assert producer.renewals == 1


async def test_other_errors_are_the_callers() -> None:
    other = FakeKafkaProducer("old", refuse_from=0, refusal=kafka_errors.RecordTooLargeError)
    producer = producer_over(other, FakeKafkaProducer("new"))
    await producer.start()
    with pytest.raises(kafka_errors.RecordTooLargeError):
        await producer.send_and_wait("t", b"m0")
    assert producer.renewals == 0


async def test_a_refused_record_is_sent_again_once_then_the_caller_retries() -> None:
    producer = producer_over(FakeKafkaProducer("a", refuse_from=0),
                             FakeKafkaProducer("b", refuse_from=0), FakeKafkaProducer("c"))
    await producer.start()
    with pytest.raises(kafka_errors.OutOfOrderSequenceNumber) as refused:
        await producer.send_and_wait("t", b"m0")
    assert isinstance(broker_error(refused.value), TransientBrokerError)
    assert await producer.send_and_wait("t", b"m0") == ("c", 0)  # the caller's retry
    assert producer.renewals == 2


async def test_a_fresh_producer_that_cannot_start_is_a_passing_failure() -> None:
    down = FakeKafkaProducer("b", start_error=kafka_errors.KafkaConnectionError("refused"))
    producer = producer_over(FakeKafkaProducer("a", refuse_from=0), down,
                             FakeKafkaProducer("c"))
    await producer.start()
    with pytest.raises(TransientBrokerError):
        await producer.send_and_wait("t", b"m0")
    assert down.stopped
    assert await producer.send_and_wait("t", b"m1") == ("c", 0)


async def test_stop_stops_the_current_producer_and_waits_for_the_replaced_one() -> None:
    broken, fresh = FakeKafkaProducer("old", refuse_from=0), FakeKafkaProducer("new")
    producer = producer_over(broken, fresh)
    await producer.start()
    await producer.send_and_wait("t", b"m0")
    await producer.stop()
    assert broken.stopped and fresh.stopped


def test_the_boundary_classes_a_broken_sequence_as_passing() -> None:
    for error in (kafka_errors.OutOfOrderSequenceNumber(), kafka_errors.UnknownProducerId(),
                  kafka_errors.ProducerFenced(), kafka_errors.InvalidProducerEpoch()):
        assert breaks_sequence(error)
        assert isinstance(broker_error(error), TransientBrokerError)
    assert not breaks_sequence(kafka_errors.RecordTooLargeError())
