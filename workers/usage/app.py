"""The accounting app: a Faust application that counts ``conveyor.usage`` into
the usage ledger and ``conveyor.feedback`` into ratings, and mirrors both
into Redis. Its data lives under ``<home>/accounting/<app id>``; why Faust
here and how each of its failures is guarded:
docs/decisions/0002-faust-on-the-cold-path-only.md."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
from faust.serializers.codecs import Codec as FaustCodec

from conveyor.metrics import LayerMetrics, LayerProbe
from conveyor.redis_clients import REDIS_ERRORS, Redis, redis_client
from conveyor.settings import Settings
from schemas.codec import Codec, EventType, default_codec
from topics.admin import Replication
from topics.backoff import RateLimitedLog
from topics.envelope import now_ms
from workers.outputs import dead_letter_record
from workers.usage.changelog import WriteBehind, drain_before_commit
from workers.usage.counting import SEEN_WINDOW, Counter, ids_before
from workers.usage.flow import batched_fetch_transport, hold_flow_until_resumed
from workers.usage.mirror import RedisMirror, UsageKeys
from workers.usage.ratings import RatingCounts, RatingKey, Ratings
from workers.usage.requests import IndexFeed
from workers.usage.rows import Counts, RowKey

__all__ = ["AccountingApp", "MIRROR_INTERVAL_S", "FULL_MIRROR_EVERY", "SWEEP_EVERY_MS",
           "FLUSH_TIMEOUT_S", "MirrorPass", "UNREADY_WARN_S", "accounting_datadir",
           "changelog_configs", "conveyor_home",
           "Undecodable", "UsageValueCodec", "STALL_AFTER_S", "Progress", "Stall", "committed",
           "consumer_state", "highwater"]

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
FULL_MIRROR_EVERY = 10  # ticks: a full pass every 5 s
UNREADY_WARN_S = 15.0  # the mirror says so when the tables stay unready this long


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
            broker=[f"kafka://{host.strip()}" for host in settings.kafka.bootstrap.split(",")
                    if host.strip()],
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
        # with no commit from its beginning (workers/usage/flow.py): set
        # before anything (a topic, a table) asks the app for its transport
        self.app.transport = batched_fetch_transport(
            self.app, frozenset({self.source_topic, self.feedback_topic}))
        # a source offset is committed only once its changelog writes are
        # acknowledged (workers/usage/changelog.py)
        self.drain = drain_before_commit(self.app.producer.buffer, FLUSH_TIMEOUT_S)
        # no event is handed to the agent between a rebalance's seek and the
        # clearing of its queue (workers/usage/flow.py)
        hold_flow_until_resumed(self.app)
        self.totals = self.app.Table("usage-totals", partitions=partitions,
                                     extra_topic_configs=changelog_configs(replication),
                                     help="row key -> counts (workers/usage/rows.py)")
        # rows changelogged once a commit, not once an event (changelog.py)
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
        # the request index (workers/usage/requests.py), written at the mirror tick
        self.index = IndexFeed(settings, self.redis)
        self._codec = default_codec()
        self._swept: dict[int, int] = {}
        self.mirroring = MirrorPass(self)
        # says so when a held partition stops being counted (Progress)
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
            await self.index.close()
            await self.redis.aclose()

        async def forget_revoked(sender: Any, /, *args: Any, signal: Any, **kwargs: Any
                                 ) -> None:
            revoked, *_ = args
            for tp in revoked:
                if tp.topic == self.source_topic:
                    self.counter.forget(tp.partition)
                    self.row_writes.drop(tp.partition)
                    self.index.forget(tp.partition)

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
            self.index.add(message.partition, message.offset, None)
            await self.dead_letter(message, value)
            return
        counted = self.counter.count(value, message.partition, message.offset)
        # a repeat too: the index keeps a request id's first row
        self.index.add(message.partition, message.offset, value)
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
        key: bytes | None = message.key
        letter = dead_letter_record(self.settings.kafka, "accounting", message.topic,
                                    message.partition, message.offset, key, data, error)
        self.probe.dead_letter()
        log.warning("usage: a value at %s[%d]@%d is not a %s (%s); dead-lettered",
                    message.topic, message.partition, message.offset, expected, letter["error"])
        ack = await self.dlq.send(key=key, value=self._codec.encode("DeadLetter", letter))
        await ack


@dataclass(frozen=True)
class Undecodable:
    """A value of the usage topic that is not a UsageRecord."""

    data: bytes
    error: str


class UsageValueCodec(FaustCodec):
    """bytes -> UsageRecord dict (or :class:`Undecodable`); the reverse for tests.
    ``event_type`` "Feedback" reads ``conveyor.feedback`` the same way."""

    def __init__(self, codec: Codec | None = None,
                 event_type: EventType = "UsageRecord") -> None:
        super().__init__()
        self.codec = codec or default_codec()
        self.event_type: EventType = event_type

    def _loads(self, s: bytes) -> Any:
        try:
            return self.codec.decode(s, self.event_type)
        except Exception as exc:  # any failure to read is a poison value, not a crash
            return Undecodable(data=bytes(s), error=f"{type(exc).__name__}: {exc}")

    def _dumps(self, s: Any) -> bytes:
        return self.codec.encode(self.event_type, s)


STALL_AFTER_S = 20.0


@dataclass(frozen=True)
class Stall:
    topic: str
    partition: int
    handled: int | None  # the last offset handled, None when none yet
    highwater: int
    idle_s: float


@dataclass
class Progress:
    """The last offset handled of each partition and when it changed."""

    clock: Callable[[], float] = time.monotonic
    stall_after_s: float = STALL_AFTER_S
    _last: dict[tuple[str, int], tuple[int | None, float]] = field(default_factory=dict)

    def handled(self, topic: str, partition: int, offset: int) -> None:
        self._last[(topic, partition)] = (offset, self.clock())

    def stalls(self, held: Iterable[tuple[str, int, int | None, int | None]]
               ) -> list[Stall]:
        """The partitions of ``held`` (topic, partition, high-water mark and
        committed offset, each None when unknown) with events past the last
        handled and the commit, and none handled for ``stall_after_s``; a
        partition seen here for the first time starts its wait now."""
        now = self.clock()
        found = []
        for topic, partition, highwater, committed in held:
            key = (topic, partition)
            if key not in self._last:
                self._last[key] = (None, now)
            offset, since = self._last[key]
            done = max(0 if offset is None else offset + 1, committed or 0)
            if highwater is None or highwater <= done:
                self._last[key] = (offset, now)  # nothing waiting: not idle
                continue
            if now - since >= self.stall_after_s:
                found.append(Stall(topic, partition, offset, highwater, now - since))
        return found


def highwater(app: Any, tp: Any) -> int | None:
    """The broker's high-water mark of ``tp`` as the consumer last fetched it."""
    try:
        return int(app.consumer.highwater(tp))
    except Exception:  # not assigned (any more), or not fetched yet
        return None


def committed(app: Any, tp: Any) -> int | None:
    """The offset Faust last committed (or sought to) on ``tp``."""
    offset = app.consumer._committed_offset.get(tp)
    return None if offset is None else int(offset)


def consumer_state(app: Any, tp: Any) -> str:
    """Faust's consumer state for ``tp``, for a log line."""
    consumer = app.consumer
    return (f"flow {'on' if consumer.flow_active else 'off'}, agents' flow "
            f"{'on' if app.flow_control.is_active() else 'off'}, "
            f"{'paused' if tp in consumer._paused_partitions else 'fetched'}, "
            f"read {consumer._read_offset.get(tp)}, committed "
            f"{consumer._committed_offset.get(tp)}, generation "
            f"{app.consumer_generation_id}, rebalancing {app.rebalancing}")


class MirrorPass:
    """The mirror tick of one accounting app (workers/usage/mirror.py says what it
    writes, and when)."""

    def __init__(self, owner: AccountingApp) -> None:
        self.owner = owner
        self._ticks = 0
        self._full_due = True
        self._problems = RateLimitedLog(log)
        self._unready_since: float | None = None

    def ready(self) -> bool:
        """Whether the tables are whole: no rebalance or recovery under way."""
        # Faust's own flags (faust-streaming 0.15.3: App.rebalancing, App.in_recovery,
        # Recovery.completed), read only; tests/unit/workers/usage/test_faust_patches.py
        app = self.owner.app
        recovery: Any = getattr(app.tables, "recovery", None)
        return (not app.rebalancing and not app.in_recovery
                and recovery is not None and recovery.completed.is_set())

    def owned(self, every: Callable[[], Iterable[tuple[str, Any]]], get: Callable[[str], Any],
              texts: Iterable[str] | None, topic: str) -> list[tuple[str, Any]]:
        """The rows of ``texts`` (``every`` row when None) counted from the
        partitions of ``topic`` this member holds: (key text, value)."""
        held = {tp.partition for tp in self.owner.app.assignor.assigned_actives()
                if tp.topic == topic}
        items = list(every()) if texts is None else [(t, get(t)) for t in texts]
        return [(t, v) for t, v in items if v is not None and v["p"] in held]

    async def mirror_once(self) -> int:
        """One tick: write the changed rows, or all of them when a full pass is due."""
        if not self.ready():
            if self._unready_since is None:
                self._unready_since = time.monotonic()
            elif time.monotonic() - self._unready_since >= UNREADY_WARN_S:
                recovery: Any = getattr(self.owner.app.tables, "recovery", None)
                self._problems.warning(
                    "unready", "usage mirror: the tables have not been whole for %.0f s "
                    "(rebalancing %s, in recovery %s, recovery complete %s); nothing mirrored",
                    time.monotonic() - self._unready_since, self.owner.app.rebalancing,
                    self.owner.app.in_recovery,
                    recovery is not None and recovery.completed.is_set())
            return 0
        if self._unready_since is not None:
            self._unready_since = None
            self._problems.resolved("unready", "usage mirror: the tables are whole again")
        self._ticks += 1
        full = self._full_due or self._ticks % FULL_MIRROR_EVERY == 0
        dirty = self.owner.counter.take_dirty()
        rated = self.owner.ratings.take_dirty()
        # read every value now (no await in between): what is written is one moment
        owner = self.owner
        rows = [(RowKey.parse(t), Counts.from_value(v)) for t, v in self.owned(
            owner.totals.items, owner.totals.get, None if full else dirty, owner.source_topic)]
        ratings = [(RatingKey.parse(t), RatingCounts.from_value(v)) for t, v in self.owned(
            owner.ratings.rows, owner.rating_table.get, None if full else rated,
            owner.feedback_topic)]
        try:
            written = await self.owner.mirror.write(rows, ratings)
        except REDIS_ERRORS as exc:
            self.owner.counter.dirty |= dirty
            self.owner.ratings.dirty |= rated
            self._full_due = True
            self._problems.warning("mirror", "usage mirror: Redis failed (%r); retrying",
                                   exc)
            return 0
        self._full_due = False
        self._problems.resolved("mirror", "usage mirror: Redis answers again")
        await self.index_once()
        return written

    async def index_once(self) -> None:
        """The request index's part of the tick (workers/usage/requests.py)."""
        owner = self.owner
        held = [tp.partition for tp in owner.app.assignor.assigned_actives()
                if tp.topic == owner.source_topic]
        try:
            await owner.index.tick(held)
        except REDIS_ERRORS as exc:
            self._problems.warning("index", "request index: Redis failed (%r); retrying", exc)
            return
        self._problems.resolved("index", "request index: Redis answers again")
