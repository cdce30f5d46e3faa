"""The layers' Sender over a producer whose idempotent session breaks: every
output still goes through, none is given up (dead-lettered) for it."""

from __future__ import annotations

from conveyor.settings import load_settings
from schemas.codec import default_codec
from schemas.records import Control
from tests.unit.topics.test_producer import FakeKafkaProducer, producer_over
from workers.outputs import Output, Sender


def cancel(i: int) -> Output:
    record = Control(request_id=f"r{i}", action="cancel", reason="test", ts_ms=i)
    return Output("t.control", "Control", record, key=f"r{i}")


async def test_outputs_refused_for_a_broken_sequence_are_produced_not_given_up() -> None:
    # as after a broker restart that expired batches: the partition's next
    # batches are refused with OutOfOrderSequenceNumber
    broken, fresh = FakeKafkaProducer("old", refuse_from=1), FakeKafkaProducer("new")
    producer = producer_over(broken, fresh)
    await producer.start()
    sender = Sender(load_settings(retry_backoff_max_s=0.01), producer, default_codec())
    await sender.produce([cancel(0), cancel(1)])
    await sender.produce([cancel(2)])
    assert len(broken.written) == 1 and len(fresh.written) == 2
    assert producer.renewals == 1


async def test_a_second_refusal_is_retried_by_the_sender() -> None:
    producer = producer_over(FakeKafkaProducer("a", refuse_from=0),
                             FakeKafkaProducer("b", refuse_from=0), FakeKafkaProducer("c"))
    await producer.start()
    sender = Sender(load_settings(retry_backoff_max_s=0.01), producer, default_codec())
    await sender.produce([cancel(0)])
