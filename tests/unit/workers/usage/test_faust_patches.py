"""Every place where the accounting app reaches into Faust's (or aiokafka's)
internals, pinned: each test fails when the internal a patch replaces or
relies on changes shape, or when the patch stops applying, so an upgrade of
faust-streaming (written against 0.15.3) or aiokafka (0.14.0) says what to
look at again instead of losing counts quietly. The list, with the reasons:
docs/decisions/0002-faust-on-the-cold-path-only.md, "Faust's internals".
Nothing here starts Faust or needs a broker."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import aiokafka
import faust
import pytest
from faust.app.base import App
from faust.tables.base import Collection
from faust.tables.recovery import RebalanceAgain, Recovery
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.transport.producer import Producer, ProducerBuffer

from conveyor.settings import load_settings
from topics.admin import Replication
from workers.usage import flow
from workers.usage.app import AccountingApp
from workers.usage.flow import hold_flow_until_resumed


def source(fun: Any) -> str:
    # a mode ServiceTask (``@Service.task``) keeps its function in ``fun``
    return inspect.getsource(getattr(fun, "fun", fun))


def params(fun: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fun).parameters)


def in_order(text: str, *parts: str) -> bool:
    """Whether every part is in ``text``, each after the one before."""
    at = 0
    for part in parts:
        found = text.find(part, at)
        if found < 0:
            return False
        at = found + len(part)
    return True


def accounting(tmp_path: Path, prefix: str) -> AccountingApp:
    return AccountingApp(load_settings(topic_prefix=prefix), Replication(1, 1, 1), home=tmp_path)


# -- workers/usage/flow.py: the flow held from on_rebalance_complete ---------


def test_faust_announces_a_rebalance_s_end_before_its_seek_and_queue_clearing() -> None:
    """The hold works only because the signal comes first: after it, Faust
    resumes the stream partitions, seeks them, clears the agents' queues
    (flow_control.resume) and only then resumes the consumer's flow."""
    for ending in (Recovery.on_recovery_completed, Recovery._resume_streams):
        assert in_order(source(ending), "on_rebalance_complete.send()",
                        "consumer.resume_partitions(", "consumer.perform_seek()",
                        "flow_control.resume()", "consumer.resume_flow()"), ending


def test_a_stopped_flow_hands_nothing_on_and_seeks_back_to_the_commits() -> None:
    """What stop_flow means to the fetch loop: getmany waits for resume_flow,
    and records fetched while the flow was off are not handed on but read
    again from the committed offsets (perform_seek)."""
    consumer = faust_consumer.Consumer
    assert params(consumer.stop_flow) == params(consumer.resume_flow) == ["self"]
    assert "self.flow_active = False" in source(consumer.stop_flow)
    assert "self.flow_active = True" in source(consumer.resume_flow)
    assert "await self.wait(self.can_resume_flow)" in source(consumer._wait_next_records)
    assert in_order(source(consumer.getmany), "if self.flow_active:", "else:",
                    "await self.perform_seek()")


async def test_the_hold_stops_the_consumer_s_flow_when_faust_announces_the_end(
        tmp_path: Path) -> None:
    app = faust.App("flow-pin", broker="kafka://127.0.0.1:9092", web_enabled=False,
                    datadir=tmp_path)
    hold_flow_until_resumed(app)
    app.consumer.resume_flow()
    await app.on_rebalance_complete.send()
    assert app.consumer.flow_active is False
    assert not app.consumer.can_resume_flow.is_set()


def test_faust_checks_the_generation_only_after_announcing_the_end() -> None:
    """Why the hold must notice a newer rebalance itself: the generation moves
    when an assignment arrives (the listener sets it before Faust's handler
    runs), so an ending after a revocation and before its assignment passes
    Faust's check and resumes everything."""
    assert in_order(source(Recovery.on_recovery_completed), "on_rebalance_complete.send()",
                    "consumer_generation_id != generation_id", "consumer.resume_partitions(",
                    "flow_control.resume()", "app.on_rebalance_end()")
    assert in_order(source(faust_aiokafka.ConsumerRebalanceListener.on_partitions_assigned),
                    "app.consumer_generation_id = generation",
                    "thread.on_partitions_assigned(")


def test_a_rebalance_is_counted_as_its_revocation_begins() -> None:
    """The hold compares App.rebalancing_count, which the aiokafka listener's
    revocation raises before anything else, with its value at the last
    assignment, which App._on_partitions_assigned announces after the tables'
    on_rebalance started that generation's recovery."""
    assert "self.rebalancing_count += 1" in source(App.on_rebalance_start)
    assert in_order(source(faust_aiokafka.ConsumerRebalanceListener.on_partitions_revoked),
                    "app.on_rebalance_start()", "thread.on_partitions_revoked(")
    assert in_order(source(App._on_partitions_assigned), "self.tables.on_rebalance",
                    "self.on_partitions_assigned.send")


def test_faust_s_recovery_loop_drops_an_ending_that_raises_rebalance_again() -> None:
    """RebalanceAgain raised from the signal ends that recovery the way an
    assignment interrupting it does: the loop waits for the next one."""
    loop = source(Recovery._restart_recovery)
    assert in_order(loop, "try:", "self._resume_streams", "self.on_recovery_completed",
                    "except RebalanceAgain", "continue")
    assert in_order(loop, "while not self.should_stop:", "self.signal_recovery_start")


async def test_the_hold_ends_a_recovery_that_a_newer_rebalance_overtook(
        tmp_path: Path) -> None:
    app = faust.App("flow-pin-again", broker="kafka://127.0.0.1:9092", web_enabled=False,
                    datadir=tmp_path)
    hold_flow_until_resumed(app)
    app.rebalancing_count += 1  # a revocation, then its assignment
    await app.on_partitions_assigned.send(set())
    app.consumer.resume_flow()
    await app.on_rebalance_complete.send()  # that generation's end: held only
    assert app.consumer.flow_active is False
    app.rebalancing_count += 1  # the next revocation, its assignment not yet here
    app.consumer.resume_flow()
    with pytest.raises(RebalanceAgain):
        await app.on_rebalance_complete.send()
    assert app.consumer.flow_active is False
    await app.on_partitions_assigned.send(set())  # that assignment's recovery ends
    await app.on_rebalance_complete.send()


# -- workers/usage/changelog.py: the producer buffer's put, hand-on and flush ------


def test_the_producer_buffer_has_what_the_drain_replaces() -> None:
    assert params(ProducerBuffer.put) == ["self", "fut"]
    assert inspect.iscoroutinefunction(ProducerBuffer._send_pending)
    assert params(ProducerBuffer._send_pending) == ["self", "fut"]
    assert inspect.iscoroutinefunction(ProducerBuffer.flush)
    assert params(ProducerBuffer.flush) == ["self"]
    # the task that hands messages on reads _send_pending once, when it starts:
    # the drain's instance attribute must be set before the buffer starts
    assert in_order(source(ProducerBuffer._handle_pending), "send_pending = self._send_pending",
                    "await send_pending(msg)", "self.message_sent.set()")
    # faust's own flush still gives up after 0.1 s without a send: the reason
    # for the drain (if this changes, the drain may no longer be needed)
    assert "timeout=0.1" in source(ProducerBuffer.flush_atmost)


def test_table_writes_reach_the_buffer_through_put_and_commits_flush_it(
        tmp_path: Path) -> None:
    assert "self.buffer.put(fut)" in source(Producer.send_soon)
    # aiokafka's Faust producer drains the buffer, then aiokafka's own, and the
    # consumer flushes it before each commit
    assert in_order(source(faust_aiokafka.Producer.flush), "await self.buffer.flush()",
                    "await self._producer.flush()")
    assert in_order(source(faust_consumer.Consumer._commit_offsets),
                    "await self.app.producer.flush()", "await self._commit(")
    app = accounting(tmp_path, "tpin-drain")
    buffer = app.app.producer.buffer
    assert (buffer.put, buffer._send_pending, buffer.flush) == (
        app.drain.put, app.drain.send_pending, app.drain.flush)
    # the drain flushes the write-behind rows first (workers/usage/changelog.py)
    assert app.drain.before == app.row_writes.flush


# -- workers/usage/flow.py: the consumer thread and the transport -----------


def test_faust_makes_its_worker_consumer_where_the_app_s_transport_says() -> None:
    thread = faust_aiokafka.AIOKafkaConsumerThread
    assert params(thread._create_worker_consumer) == ["self", "transport"]
    assert params(faust_aiokafka.Consumer._new_consumer_thread) == ["self"]
    assert "self.Consumer(self" in source(faust.transport.base.Transport.create_consumer)
    # the fetch settings the subclass sets are read when aiokafka's consumer starts
    start = source(aiokafka.AIOKafkaConsumer.start)
    assert "fetch_min_bytes=self._fetch_min_bytes" in start
    assert "fetch_max_wait_ms=self._fetch_max_wait_ms" in start


def test_faust_s_seek_to_committed_goes_through_the_consumer_thread() -> None:
    thread = faust_aiokafka.AIOKafkaConsumerThread
    assert inspect.iscoroutinefunction(thread.seek_to_committed)
    assert params(thread.seek_to_committed) == params(flow._ConsumerThread.seek_to_committed)
    assert "await self.seek_to_committed()" in source(faust_consumer.Consumer.perform_seek)
    assert "self._thread.seek_to_committed()" in source(
        faust_consumer.ThreadDelegateConsumer.seek_to_committed)
    assert params(thread.call_thread)[:2] == ["self", "fun"]
    assert params(thread._ensure_consumer) == ["self"]
    # aiokafka still leaves a partition with no commit (or 0) where it was: the
    # reason for seek_committed_or_earliest
    assert "if offset and offset > 0:" in source(aiokafka.AIOKafkaConsumer.seek_to_committed)


def test_the_accounting_app_s_consumer_is_the_batched_one(tmp_path: Path) -> None:
    app = accounting(tmp_path, "tpin-fetch")
    assert isinstance(app.app.transport, flow._Transport)
    assert isinstance(app.app.consumer, flow._Consumer)
    assert isinstance(cast(Any, app.app.consumer)._thread, flow._ConsumerThread)


# -- workers/usage/changelog.py: the table's store and its changelog ----------


def test_a_table_has_the_store_and_changelog_send_write_behind_uses(tmp_path: Path) -> None:
    assert params(Collection.send_changelog) == ["self", "partition", "key", "value",
                                                 "key_serializer", "value_serializer"]
    app = accounting(tmp_path, "tpin-rows")
    # writing the store does not write the changelog: Table.__setitem__ would
    app.row_writes["k"] = {"p": 2, "o": 1}
    assert app.totals.data["k"] == {"p": 2, "o": 1}
    assert app.drain.put_count == 0
    # the flush sends the row to the changelog partition it names
    sent: list[tuple[int, str, Any]] = []
    cast(Any, app.totals).send_changelog = (
        lambda partition, key, value, **kw: sent.append((partition, key, value)))
    assert app.row_writes.flush() == 1 and sent == [(2, "k", {"p": 2, "o": 1})]


# -- workers/usage/app.py (MirrorPass): what the mirror reads of Faust's state -


def test_faust_keeps_the_state_the_mirror_reads(tmp_path: Path) -> None:
    app = accounting(tmp_path, "tpin-mirror").app
    assert app.rebalancing is False and app.in_recovery is False
    recovery = app.tables.recovery
    assert isinstance(recovery.completed, asyncio.Event)
    assert callable(app.assignor.assigned_actives)


async def test_a_partition_without_a_position_is_left_out_of_faust_s_livelock_check() -> None:
    """Faust's check reads a partition's position, which aiokafka asserts is set:
    a partition whose reset has not landed (read from its beginning) crashed
    the app (seen in CI). The patch checks it only once it has one."""
    import inspect
    from types import SimpleNamespace

    from aiokafka import TopicPartition
    from aiokafka.consumer.subscription_state import Assignment
    from faust.transport.drivers import aiokafka as faust_aiokafka

    from workers.usage.flow import _ConsumerThread, has_position

    assert "tp_state.position" in inspect.getsource(
        faust_aiokafka.AIOKafkaConsumerThread.verify_event_path)
    tp = TopicPartition("t.usage", 2)
    assignment = Assignment([tp])
    consumer: Any = SimpleNamespace(_fetcher=SimpleNamespace(_subscriptions=SimpleNamespace(
        subscription=SimpleNamespace(assignment=assignment))))
    with pytest.raises(AssertionError):
        assignment.state_value(tp).position  # noqa: B018  (what crashed)
    assert not has_position(consumer, tp)
    thread: Any = SimpleNamespace(_ensure_consumer=lambda: consumer)
    assert _ConsumerThread.verify_event_path(thread, 0.0, tp) is None
    assignment.state_value(tp).seek(5)
    assert has_position(consumer, tp)
