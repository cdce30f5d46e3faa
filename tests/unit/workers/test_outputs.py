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


def test_replies_bound_for_one_gateway_go_out_as_one_record_in_order() -> None:
    """A layer's outputs for one record it handled: the replies of each reply
    partition become one record (where the first of them was, naming their
    requests), other events pass as they are, and a reply alone is a record
    of one."""
    from conveyor.settings import load_settings
    from schemas.records import Reply
    from topics.catalog import REPLIES
    from topics.envelope import new_envelope
    from topics.reader import REQUEST_IDS
    from workers.outputs import Output, packed

    kafka = load_settings(topic_prefix="t").kafka

    def reply(rid: str, partition: int, index: int) -> Output:
        envelope = new_envelope(rid, reply_gateway="g", reply_partition=partition)
        return Output(REPLIES.at(kafka), "Reply", Reply(
            envelope=envelope, index=index, kind="delta", text=f"{rid}{index}", chunk="",
            finish_reason=None, usage=None, error=None), key=rid, partition=partition)

    usage = Output("t.usage", "UsageRecord", {"tenant": "x"}, key="x")
    out = packed(kafka, [reply("a", 0, 0), reply("b", 1, 0), usage, reply("a", 0, 1),
                         reply("c", 0, 0)])
    assert [(o.event_type, o.partition) for o in out] == [
        ("ReplyBatch", 0), ("ReplyBatch", 1), ("UsageRecord", None)]
    assert [r["text"] for r in out[0].record["replies"]] == ["a0", "a1", "c0"]
    assert dict(out[0].headers)[REQUEST_IDS] == b"a,c" and out[0].key is None
    assert out[2] is usage
    d5 = reply("d", 2, 5)
    [alone] = packed(kafka, [d5])
    assert alone.record == {"replies": [d5.record]} and alone.partition == 2
    assert packed(kafka, [usage]) == [usage]


def test_large_replies_for_one_gateway_go_out_as_records_that_each_fit() -> None:
    """Embeddings' answers are large: the replies that would outgrow one event
    begin a second record after the first, in order."""
    from conveyor.settings import load_settings
    from schemas.records import Reply
    from topics.catalog import REPLIES
    from topics.envelope import new_envelope
    from workers.outputs import RECORD_MARGIN, Output, packed

    kafka = load_settings(topic_prefix="t", max_event_bytes=RECORD_MARGIN + 10_000).kafka

    def reply(rid: str, size: int) -> Output:
        envelope = new_envelope(rid, reply_gateway="g", reply_partition=0)
        return Output(REPLIES.at(kafka), "Reply", Reply(
            envelope=envelope, index=0, kind="final", text="", chunk="x" * size,
            finish_reason="stop", usage=None, error=None), key=rid, partition=0)

    out = packed(kafka, [reply("a", 3000), reply("b", 2000), reply("c", 4000), reply("d", 10)])
    assert [[r["envelope"]["request_id"] for r in o.record["replies"]] for o in out] == [
        ["a", "b"], ["c", "d"]]
