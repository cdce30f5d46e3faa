"""The accounting app: a Faust application that turns ``conveyor.usage`` into
the usage ledger (per key, tenant and model, by minute and by day) and
``conveyor.feedback`` into ratings, and mirrors both into Redis.

Faust is here, and only here, because its tables restored from changelogs
pay on this cold path (docs/decisions/0002-faust-on-the-cold-path-only.md,
with what each guard below fixed and measured).

- **Names.** App id and group ``settings.kafka.group("accounting")``, so a
  ``topic_prefix`` has its own group and changelogs; Faust's data directory
  is ``<home>/accounting/<app id>`` (:func:`accounting_datadir`, under
  :func:`conveyor_home`).
- **Membership.** Dynamic, with the settings' session timeout and heartbeat.
- **Tables.** ``usage-totals`` (workers/usage/rows.py, counting.py),
  partitioned like the usage topic, and ``feedback-ratings`` (ratings.py); in
  memory, no standby replicas. Changelogs compacted in 1 MiB segments
  (Kafka compacts only closed ones), tombstones kept an hour; these configs
  apply when the topic is created.
- **Repeats.** A window of request ids per partition, in memory, read back
  from the usage topic when a partition's events start somewhere new
  (workers/usage/seen.py).
- **Faust's failures guarded**: the flow held through a rebalance's end, and
  a recovery that ends inside the next rebalance resumes nothing (flow.py),
  batched fetches and never-committed partitions read again (fetching.py),
  rows changelogged once a commit (write_behind.py), a commit only after its
  changelog writes are acknowledged (drain.py).
- **Retention.** Each partition swept at most once a minute, while one of its
  events is in hand (a table changes only then).
- **Poison values** go to ``conveyor.dlq`` as DeadLetters (decode.py).
- **Progress.** A held partition with events waiting and none counted for
  20 s is a warning with Faust's state of it (progress.py).
- **Mirror.** Every ``MIRROR_INTERVAL_S`` (mirroring.py); the tables are the
  record, Redis is the copy.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import faust

from conveyor.metrics import LayerMetrics, LayerProbe
from conveyor.redis_clients import Redis, redis_client
from conveyor.settings import Settings
from schemas.codec import default_codec
from schemas.records import DeadLetter
from topics.admin import Replication
from topics.backoff import RateLimitedLog
from topics.envelope import now_ms
from workers.usage.counting import SEEN_WINDOW, Counter
from workers.usage.decode import Undecodable, UsageValueCodec
from workers.usage.drain import drain_before_commit
from workers.usage.fetching import batched_fetch_transport
from workers.usage.flow import hold_flow_until_resumed
from workers.usage.layout import UsageKeys
from workers.usage.mirror import RedisMirror
from workers.usage.mirroring import FULL_MIRROR_EVERY, MirrorPass
from workers.usage.progress import Progress, committed, consumer_state, highwater
from workers.usage.ratings import Ratings
from workers.usage.seen import ids_before
from workers.usage.write_behind import WriteBehind

__all__ = ["AccountingApp", "MIRROR_INTERVAL_S", "FULL_MIRROR_EVERY", "SWEEP_EVERY_MS",
           "FLUSH_TIMEOUT_S", "accounting_datadir", "changelog_configs", "conveyor_home"]

log = logging.getLogger(__name__)

MIRROR_INTERVAL_S = 0.5
PROGRESS_CHECK_S = 5.0  # how often the app looks for a partition it stopped counting
SWEEP_EVERY_MS = 60_000
# a commit waits this long for the changelog writes before it fails (and the
# events are read again) rather than commit past writes that are not durable
FLUSH_TIMEOUT_S = 120.0
PRODUCER_LINGER_S = 0.01  # the changelog producer batches for 10 ms
CHANGELOG_SEGMENT_BYTES = 1024 * 1024
TOMBSTONES_KEPT_MS = 3_600_000
# room a dead letter keeps for its own fields (as workers/outputs.py)
_LETTER_OVERHEAD = 16 * 1024


def changelog_configs(replication: Replication) -> dict[str, str]:
    """Topic configs of the totals changelog (Faust adds ``cleanup.policy=compact``)."""
    return {**replication.configs(), "segment.bytes": str(CHANGELOG_SEGMENT_BYTES),
            "delete.retention.ms": str(TOMBSTONES_KEPT_MS)}


def conveyor_home(environ: Mapping[str, str]) -> Path:
    """Conveyor's home directory as infra/ scripts know it: ``CONVEYOR_HOME``,
    else ``.conveyor`` in the current directory; absolute, so that a later
    change of directory does not move it."""
    return Path(environ.get("CONVEYOR_HOME") or ".conveyor").absolute()


def accounting_datadir(home: Path, app_id: str) -> Path:
    """Faust's data directory of the app ``app_id``: ``<home>/accounting/<app id>``."""
    return home / "accounting" / app_id


def _brokers(bootstrap: str) -> list[str]:
    return [f"kafka://{host.strip()}" for host in bootstrap.split(",") if host.strip()]


class AccountingApp:
    """One Faust app for one Settings, with its tables, agent and mirror timer."""

    def __init__(self, settings: Settings, replication: Replication,
                 redis: Redis | None = None, probe: LayerProbe | None = None,
                 window: int = SEEN_WINDOW, home: Path | None = None) -> None:
        self.settings = settings
        self.probe = probe or LayerMetrics.off().layer("accounting")
        self.source_topic = settings.kafka.topic("usage")
        partitions = settings.kafka.pipeline_partitions
        app_id = settings.kafka.group("accounting")
        self.datadir = accounting_datadir(
            conveyor_home(os.environ) if home is None else home, app_id)
        # Faust makes the data directory at start, but not the ones above it
        self.datadir.parent.mkdir(parents=True, exist_ok=True)
        self.app = faust.App(
            app_id,
            broker=_brokers(settings.kafka.bootstrap),
            datadir=self.datadir,
            store="memory://",
            web_enabled=False,
            processing_guarantee="at_least_once",
            topic_partitions=partitions,
            topic_replication_factor=replication.factor,
            table_standby_replicas=0,
            producer_acks=-1,
            # a usage event's seven row writes, and those of the events beside it,
            # go to the broker in one request (the path is cold: the client has
            # its answer)
            producer_linger=PRODUCER_LINGER_S,
            producer_max_request_size=settings.kafka.max_event_bytes,
            broker_session_timeout=settings.kafka.consumer_session_timeout_ms / 1000,
            broker_heartbeat_interval=settings.kafka.consumer_heartbeat_interval_ms / 1000,
            broker_commit_interval=1.0,
            consumer_auto_offset_reset="earliest",
        )
        self.feedback_topic = settings.kafka.topic("feedback")
        # usage is fetched in batches, and a rebalance reads a counted partition
        # with no commit from its beginning (workers/usage/fetching.py): set
        # before anything (a topic, a table) asks the app for its transport
        self.app.transport = batched_fetch_transport(
            self.app, frozenset({self.source_topic, self.feedback_topic}))
        # a source offset is committed only once its changelog writes are
        # acknowledged (workers/usage/drain.py)
        self.drain = drain_before_commit(self.app.producer.buffer, FLUSH_TIMEOUT_S)
        # no event is handed to the agent between a rebalance's seek and the
        # clearing of its queue (workers/usage/flow.py)
        hold_flow_until_resumed(self.app)
        self.totals = self.app.Table("usage-totals", partitions=partitions,
                                     extra_topic_configs=changelog_configs(replication),
                                     help="row key -> counts (workers/usage/rows.py)")
        # rows changelogged once a commit, not once an event (write_behind.py)
        self.row_writes = WriteBehind(self.totals)
        self.drain.before = self.row_writes.flush
        self.counter = Counter(self.row_writes, now_ms, window)
        # ratings (workers/usage/ratings.py): conveyor.feedback has one partition
        # (rows and latest ratings in one table: one changelog, written in order)
        self.rating_table = self.app.Table(
            "feedback-ratings", partitions=1, extra_topic_configs=changelog_configs(replication),
            help="rating rows and each request's latest rating (workers/usage/ratings.py)")
        self.ratings = Ratings(self.rating_table, now_ms)
        self.feedback = self.app.topic(self.feedback_topic, key_serializer="raw",
                                       value_serializer=UsageValueCodec(event_type="Feedback"))
        self._ratings_swept = 0
        self.source = self.app.topic(self.source_topic, key_serializer="raw",
                                     value_serializer=UsageValueCodec())
        self.dlq = self.app.topic(settings.kafka.topic("dlq"), key_serializer="raw",
                                  value_serializer="raw")
        self.redis = redis or redis_client(settings.redis, "accounting")
        self.mirror = RedisMirror(self.redis, UsageKeys(settings.kafka.topic_prefix))
        self._codec = default_codec()
        self._swept: dict[int, int] = {}
        self.mirroring = MirrorPass(self)
        # says so when a held partition stops being counted (workers/usage/progress.py)
        self.progress = Progress()
        self._stalls = RateLimitedLog(log)

        async def account(stream: faust.StreamT[Any]) -> AsyncIterator[None]:
            async for event in stream.events():
                started = time.perf_counter()
                await self.on_event(event)
                self.probe.handled(time.perf_counter() - started)
                yield None

        async def rate(stream: faust.StreamT[Any]) -> AsyncIterator[None]:
            async for event in stream.events():
                await self.on_feedback(event)
                yield None

        async def mirror_tick() -> None:
            await self.mirroring.mirror_once()

        async def progress_tick() -> None:
            self.check_progress()

        async def close_redis(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
            await self.redis.aclose()

        async def forget_revoked(sender: Any, /, *args: Any, signal: Any, **kwargs: Any
                                 ) -> None:
            revoked, *_ = args
            for tp in revoked:
                if tp.topic == self.source_topic:
                    self.counter.forget(tp.partition)
                    self.row_writes.drop(tp.partition)

        async def log_assigned(sender: Any, /, *args: Any, signal: Any, **kwargs: Any
                               ) -> None:
            # which member counts what: the first thing to know when counting stops
            assigned, *_ = args
            held = sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned
                          if tp.topic in (self.source_topic, self.feedback_topic))
            log.info("accounting: this member now holds %s",
                     ", ".join(held) or "no partition of usage or feedback")

        self.app.agent(self.source, name=f"{app_id}.account")(account)
        self.app.agent(self.feedback, name=f"{app_id}.rate")(rate)
        self.app.timer(MIRROR_INTERVAL_S, name="usage-mirror")(mirror_tick)
        self.app.timer(PROGRESS_CHECK_S, name="usage-progress")(progress_tick)
        self.app.on_before_shutdown.connect(close_redis)
        # a member keeps the request ids of the partitions it owns, no others
        self.app.on_partitions_revoked.connect(forget_revoked)
        self.app.on_partitions_assigned.connect(log_assigned)

    # -- counting --------------------------------------------------------

    def check_progress(self) -> None:
        """Warn (rate-limited) of each held usage or feedback partition with
        events waiting and none counted for a while, with Faust's state of it."""
        held = [tp for tp in self.app.assignor.assigned_actives()
                if tp.topic in (self.source_topic, self.feedback_topic)]
        stalls = self.progress.stalls(
            (tp.topic, tp.partition, highwater(self.app, tp), committed(self.app, tp))
            for tp in held)
        for stall in stalls:
            tp = next(tp for tp in held
                      if (tp.topic, tp.partition) == (stall.topic, stall.partition))
            self._stalls.warning(
                f"stall {stall.topic}[{stall.partition}]",
                "accounting: %s[%d] holds events up to %d, the last handled %s, none "
                "handled for %.0f s (%s)", stall.topic, stall.partition, stall.highwater,
                stall.handled, stall.idle_s, consumer_state(self.app, tp))

    async def on_event(self, event: Any) -> None:
        message = event.message
        self.progress.handled(message.topic, message.partition, message.offset)
        if self.counter.needs_window(message.partition, message.offset):
            await self.read_back(message.partition, message.offset)
        value = event.value
        if not isinstance(value, dict):
            self.counter.skip(message.partition, message.offset)
            await self.dead_letter(message, value)
            return
        counted = self.counter.count(value, message.partition, message.offset)
        log.debug("usage %s of %s: %s", value["request_id"], value["tenant"],
                  "counted" if counted else "a repeat, dropped")
        now = now_ms()
        if now - self._swept.get(message.partition, 0) >= SWEEP_EVERY_MS:
            self._swept[message.partition] = now
            dropped = self.counter.sweep(message.partition)
            if dropped:
                log.info("usage ledger: %d entries of partition %d past their retention "
                         "dropped", dropped, message.partition)

    async def on_feedback(self, event: Any) -> None:
        """One rating (workers/usage/ratings.py); a value that is not one is
        dead-lettered."""
        message = event.message
        self.progress.handled(message.topic, message.partition, message.offset)
        value = event.value
        if not isinstance(value, dict):
            await self.dead_letter(message, value, "Feedback")
            return
        counted = self.ratings.count(value, message.partition, message.offset)
        log.debug("rating of %s by %s: %s", value["request_id"], value["tenant"],
                  "counted" if counted else "counted before, passed over")
        now = now_ms()
        if now - self._ratings_swept >= SWEEP_EVERY_MS:
            self._ratings_swept = now
            self.ratings.sweep()

    async def read_back(self, partition: int, offset: int) -> None:
        """Read the request ids before ``offset`` back from the usage topic."""
        started = time.perf_counter()
        before = await ids_before(self.settings, self.source_topic, partition, offset,
                                  self.counter.window, self._codec)
        self.counter.load_window(partition, offset, before)
        log.info("usage: %d request ids before %s[%d]@%d read back in %.2f s",
                 len(self.counter.windows[partition]), self.source_topic, partition, offset,
                 time.perf_counter() - started)

    async def dead_letter(self, message: Any, value: Any,
                          expected: str = "UsageRecord") -> None:
        """``value`` (an :class:`Undecodable`, or None for an empty one) to the DLQ."""
        data = value.data if isinstance(value, Undecodable) else message.value
        error = value.error if isinstance(value, Undecodable) else "an empty value"
        room = max(0, self.settings.kafka.max_event_bytes - _LETTER_OVERHEAD)
        if data is not None and len(data) > room:
            error = f"[value truncated to {room} of {len(data)} bytes] " + error
            data = data[:room]
        key: bytes | None = message.key
        letter = DeadLetter(layer="accounting", topic=message.topic,
                            partition=message.partition, offset=message.offset, key=key,
                            value=data, error=error[:4000], ts_ms=now_ms())
        self.probe.dead_letter()
        log.warning("usage: a value at %s[%d]@%d is not a %s (%s); dead-lettered",
                    message.topic, message.partition, message.offset, expected, error)
        ack = await self.dlq.send(key=key, value=self._codec.encode("DeadLetter", letter))
        await ack
