"""The request index in Redis: every finished request (one UsageRecord) as a
row, and sorted sets of request ids by ``finished_ms`` (all of them, and one
per tenant, key, model and status), kept ``request_index_days``
(:func:`index_retention_ms`).
:class:`RequestIndex` reads it (the console's request search and live
tail); the accounting app writes it (:class:`IndexFeed`, from its mirror
tick) and rebuilds it from ``conveyor.usage`` after a Redis flush. The
layout, the marks that say how far each usage partition is indexed, and
what is guaranteed: docs/decisions/0002-faust-on-the-cold-path-only.md."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass, fields
from typing import Any

from aiokafka import TopicPartition

from conveyor.errors import InvalidRequest
from conveyor.redis_clients import Redis, text
from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from schemas.records import UsageRecord
from topics.backoff import RateLimitedLog
from topics.catalog import USAGE
from topics.clients import BROKER_TROUBLE, make_consumer, stop_consumer
from topics.envelope import now_ms
from workers.usage.rows import DAY_MS

__all__ = ["RequestRow", "RequestPage", "RequestIndex", "IndexKeys", "IndexWriter", "IndexFeed",
           "index_retention_ms", "SCAN_LIMIT", "MAX_LIMIT", "FILTERS"]

log = logging.getLogger(__name__)

# one search walks at most this many ids of its most selective set
SCAN_LIMIT = 5_000
MAX_LIMIT = 1_000
_WALK = 500  # ids read a round trip while filtering
FILTERS = ("tenant", "key", "model", "status")


@dataclass(frozen=True)
class RequestRow:
    """One UsageRecord as the index keeps it: its fields, in its order (a
    record of an older version, and a row written before, lacks the last)."""

    request_id: str
    tenant: str
    key_id: str
    model: str
    kind: str
    status: str
    prompt_tokens: int
    completion_tokens: int
    entered_ms: int
    finished_ms: int
    first_token_ms: int | None = None
    error_code: str | None = None  # the code of the error that ended it
    asked_model: str = ""  # the model asked for, when another answered

    @classmethod
    def of(cls, record: UsageRecord) -> RequestRow:
        """The row of one UsageRecord."""
        given: dict[str, Any] = {name: value for name, value in record.items()
                                 if name in _FIELDS and value is not None}
        return cls(**given)

    def encode(self) -> str:
        return json.dumps(astuple(self), separators=(",", ":"))

    @classmethod
    def decode(cls, data: str | bytes) -> RequestRow:
        """A row as :meth:`encode` wrote it: one of an older version lacks
        trailing fields (their defaults), one of a newer version may have
        more (left out, for a rolling deploy reads both)."""
        return cls(*json.loads(data)[:len(_FIELDS)])

    def value_of(self, dim: str) -> str:
        """The row's value of a filter dimension (:data:`FILTERS`)."""
        return {"tenant": self.tenant, "key": self.key_id, "model": self.model,
                "status": self.status}[dim]


_FIELDS = tuple(f.name for f in fields(RequestRow))


def index_retention_ms(settings: Settings) -> int:
    """What the console finds: ``request_index_days`` (within the usage topic's
    retention, which the index is rebuilt from)."""
    return min(int(settings.redis.request_index_days * DAY_MS), USAGE.retention_ms)


@dataclass(frozen=True)
class RequestPage:
    rows: list[RequestRow]  # newest finished first
    complete: bool  # False while the index is being rebuilt (after a Redis flush) or not built yet
    more: bool  # True when more rows match beyond `limit` (or the scan bound was hit)


@dataclass(frozen=True)
class IndexKeys:
    prefix: str

    def row(self, request_id: str) -> str:
        """STRING: the row of one request (:meth:`RequestRow.encode`)."""
        return f"{self.prefix}:requests:row:{request_id}"

    def finished(self, dim: str | None = None, value: str = "") -> str:
        """ZSET of request ids by finished_ms: all of them, or those of one
        tenant, key, model or status (``dim``)."""
        if dim is None:
            return f"{self.prefix}:requests:all"
        if dim not in FILTERS:
            raise ValueError(f"the index has no sets by {dim!r}")
        return f"{self.prefix}:requests:by-{dim}:{value}"

    def marks(self) -> str:
        """HASH: usage partition -> the next offset indexed (everything before it
        is), -1 while the partition is rebuilt."""
        return f"{self.prefix}:requests:indexed"

    def sets_of(self, row: RequestRow) -> list[str]:
        return [self.finished(), *(self.finished(dim, row.value_of(dim)) for dim in FILTERS)]


class IndexWriter:
    """Writes rows into the index: each once (the first copy of a request id
    stays), so writing a record again changes nothing."""

    def __init__(self, redis: Redis, keys: IndexKeys, retention_ms: int,
                 clock: Callable[[], int] = now_ms, batch: int = 3000) -> None:
        self.redis = redis
        self.keys = keys
        self.clock = clock
        self.retention_ms = retention_ms
        self.batch = batch

    async def write(self, rows: Iterable[RequestRow]) -> int:
        """Write ``rows`` (those still within the retention); how many. Raises
        redis's errors: the caller writes them again."""
        now = self.clock()
        oldest = now - self.retention_ms
        written = 0
        pipe = self.redis.pipeline(transaction=False)
        touched: set[str] = set()
        for row in rows:
            if row.finished_ms < oldest:
                continue
            pipe.set(self.keys.row(row.request_id), row.encode(), nx=True,
                     pxat=row.finished_ms + self.retention_ms)
            for name in self.keys.sets_of(row):
                pipe.zadd(name, {row.request_id: row.finished_ms}, nx=True)
                touched.add(name)
            written += 1
            if len(pipe) >= self.batch:
                self._trim(pipe, touched, oldest, now)
                await pipe.execute()
                pipe = self.redis.pipeline(transaction=False)
                touched = set()
        if len(pipe):
            self._trim(pipe, touched, oldest, now)
            await pipe.execute()
        return written

    def _trim(self, pipe: Any, names: set[str], oldest: int, now: int) -> None:
        """Each set written: its ids past the retention out, and the set gone a
        retention after its last write."""
        for name in names:
            pipe.zremrangebyscore(name, "-inf", f"({oldest}")
            pipe.pexpireat(name, now + self.retention_ms)


class RequestIndex:
    """The index's reader."""

    def __init__(self, settings: Settings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = IndexKeys(settings.kafka.topic_prefix)
        self.partitions = settings.kafka.pipeline_partitions
        self.retention_ms = index_retention_ms(settings)

    async def get(self, request_id: str) -> RequestRow | None:
        data = await self.redis.get(self.keys.row(request_id))
        return None if data is None else RequestRow.decode(data)

    async def rows(self, request_ids: list[str]) -> list[RequestRow | None]:
        """The rows of ``request_ids``, in one round trip (None: not indexed)."""
        if not request_ids:
            return []
        found = await self.redis.mget([self.keys.row(rid) for rid in request_ids])
        return [None if data is None else RequestRow.decode(data) for data in found]

    async def complete(self) -> bool:
        """Whether every usage partition is indexed (none being rebuilt)."""
        return self._complete(await self.redis.hgetall(self.keys.marks()))

    def _complete(self, marks: dict[Any, Any]) -> bool:
        indexed = {int(text(p)) for p, v in marks.items() if int(text(v)) >= 0}
        return indexed >= set(range(self.partitions))

    async def search(self, *, tenant: str | None = None, key_id: str | None = None,
                     model: str | None = None, status: str | None = None,
                     since_ms: int | None = None, until_ms: int | None = None,
                     limit: int = 50) -> RequestPage:
        """The requests that finished in ``[since_ms, until_ms)`` (the index's
        retention when not given) and match every filter given, newest first,
        at most ``limit``; with no filter, the latest finished (the live tail).
        Walks the most selective set, at most :data:`SCAN_LIMIT` of its ids."""
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidRequest(f"limit must be 1 to {MAX_LIMIT}, not {limit}", param="limit")
        wanted = {dim: value for dim, value in zip(
            FILTERS, (tenant, key_id, model, status), strict=True) if value is not None}
        low = max(since_ms or 0, now_ms() - self.retention_ms)
        high = "+inf" if until_ms is None else f"({until_ms}"
        sets = [self.keys.finished(dim, value) for dim, value in wanted.items()] \
            or [self.keys.finished()]
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.marks())
        if len(sets) > 1:
            for name in sets:
                pipe.zcount(name, low, high)
        marks, *sizes = await pipe.execute()
        complete = self._complete(marks)
        if until_ms is not None and until_ms <= low:
            return RequestPage([], complete, False)
        walked = sets[0] if len(sets) == 1 else min(zip(sizes, sets, strict=True))[1]
        # with one filter every id of its set matches: a page is one read
        step = limit + 1 if len(sets) == 1 else _WALK
        rows: list[RequestRow] = []
        scanned = 0
        exhausted = False
        while len(rows) <= limit and scanned < SCAN_LIMIT:
            count = min(step, SCAN_LIMIT - scanned)
            ids = await self.redis.zrevrangebyscore(walked, high, low, start=scanned,
                                                    num=count)
            if ids:
                found = await self.redis.mget([self.keys.row(text(i)) for i in ids])
                for data in found:
                    if data is None:
                        continue  # past its retention, not trimmed yet
                    row = RequestRow.decode(data)
                    if all(row.value_of(dim) == value for dim, value in wanted.items()):
                        rows.append(row)
            scanned += len(ids)
            if len(ids) < count:
                exhausted = True
                break
        more = len(rows) > limit or (not exhausted and scanned >= SCAN_LIMIT)
        return RequestPage(rows[:limit], complete, more)


_ADVANCE = """
local out = {}
for i = 1, #ARGV, 2 do
  local cur = redis.call('HGET', KEYS[1], ARGV[i])
  if not cur then
    out[#out + 1] = -1
  elseif tonumber(cur) < 0 then
    out[#out + 1] = 0
  else
    if tonumber(ARGV[i + 1]) > tonumber(cur) then
      redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    end
    out[#out + 1] = 1
  end
end
return out
"""

_FINISH = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

_RETRY_S = 5.0  # a catch-up that failed starts again this much later
MAX_PENDING = 100_000  # rows held for Redis a partition, past which they are read again


class IndexFeed:
    """The accounting app's writer of the index. The app hands it every usage
    record it reads (:meth:`add`); each tick (:meth:`tick`) writes them and
    moves each held partition's mark on. A partition held without a mark
    in Redis, or whose mark is behind the first record handed, is caught up
    from the usage topic first, in a task of its own (a missing mark: the
    index's retention read again, the partition marked -1 meanwhile)."""

    def __init__(self, settings: Settings, redis: Redis, clock: Callable[[], int] = now_ms,
                 codec: Codec | None = None, max_pending: int = MAX_PENDING) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = IndexKeys(settings.kafka.topic_prefix)
        self.writer = IndexWriter(redis, self.keys, index_retention_ms(settings), clock)
        self.clock = clock
        self.codec = codec or default_codec()
        self.topic = settings.kafka.topic("usage")
        self.max_pending = max_pending
        self.pending: dict[int, list[RequestRow]] = {}
        self.last: dict[int, int] = {}  # partition -> the last offset handed
        self.live: set[int] = set()  # partitions caught up: their marks follow `last`
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self._retry_at: dict[int, float] = {}
        self._advance = redis.register_script(_ADVANCE)
        self._finish = redis.register_script(_FINISH)
        self._problems = RateLimitedLog(log)

    def add(self, partition: int, offset: int, record: Any | None) -> None:
        """The record at ``offset`` of ``partition`` (None: no UsageRecord there)."""
        if record is not None:
            rows = self.pending.setdefault(partition, [])
            rows.append(RequestRow.of(record))
            if len(rows) > self.max_pending:
                # Redis has been gone a while: read them again once it is back
                del self.pending[partition]
                self.live.discard(partition)
                log.warning("request index: over %d rows of usage[%d] waiting for Redis; "
                            "dropped, to be read again from the topic", self.max_pending,
                            partition)
        self.last[partition] = max(offset, self.last.get(partition, -1))

    def forget(self, partition: int) -> None:
        """``partition`` went to another member: its state goes, and its catch-up."""
        task = self.tasks.pop(partition, None)
        if task is not None:
            task.cancel()
        self.pending.pop(partition, None)
        self.last.pop(partition, None)
        self.live.discard(partition)
        self._retry_at.pop(partition, None)

    async def close(self) -> None:
        for partition in list(self.tasks):
            self.forget(partition)

    def complete_for(self, held: Iterable[int]) -> bool:
        """Whether every partition of ``held`` is caught up (this process's view)."""
        return all(p in self.live for p in held)

    async def tick(self, held: Iterable[int]) -> int:
        """Write what was handed since the last tick and move the marks of the
        ``held`` partitions on; start the catch-ups due. How many rows were
        written; raises redis's errors (what was handed is kept)."""
        held = set(held)
        for partition in [p for p in self.tasks if p not in held]:
            self.forget(partition)
        for partition in [p for p in self.pending if p not in held]:
            del self.pending[partition]
        self._reap()
        pending, self.pending = self.pending, {}
        last = {p: self.last[p] for p in self.live & held if p in self.last}
        try:
            written = await self.writer.write(row for rows in pending.values() for row in rows)
        except BaseException:
            for partition, rows in pending.items():  # before any handed meanwhile
                self.pending[partition] = rows + self.pending.get(partition, [])
            raise
        live = sorted(self.live & held)
        if live:
            args: list[int] = []
            for partition in live:
                args += [partition, last[partition] + 1 if partition in last else 0]
            answers = await self._advance(keys=[self.keys.marks()], args=args)
            gone = [p for p, answer in zip(live, answers, strict=True) if int(answer) < 0]
            if gone:
                log.warning("request index: the marks of usage%s are gone (a Redis flush?); "
                            "rebuilding them from the topic", gone)
                self.live.difference_update(gone)
        now = time.monotonic()
        for partition in sorted(held - self.live - set(self.tasks)):
            if self._retry_at.get(partition, 0.0) <= now:
                self.tasks[partition] = asyncio.create_task(
                    self._catch_up(partition), name=f"request-index-{partition}")
        return written

    def _reap(self) -> None:
        for partition, task in list(self.tasks.items()):
            if not task.done():
                continue
            del self.tasks[partition]
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is None:
                self._problems.resolved(f"catch-up {partition}",
                                        "request index: usage[%d] caught up again", partition)
                continue
            self._retry_at[partition] = time.monotonic() + _RETRY_S
            self._problems.warning(f"catch-up {partition}",
                                   "request index: catching up usage[%d] failed (%r); retrying",
                                   partition, exc)

    async def _catch_up(self, partition: int) -> None:
        """Index usage[partition] from its mark (from the retention's start,
        without one) to its end as of now, then follow its live records."""
        marks = self.keys.marks()
        mark = await self.redis.hget(marks, str(partition))
        full = mark is None or int(text(mark)) < 0
        if full:
            await self.redis.hset(marks, str(partition), "-1")
            expected = "-1"
        else:
            expected = text(mark)
        started = time.perf_counter()
        start = None if full else int(expected)
        end, count = await self._read(partition, start)
        if not await self._finish(keys=[marks], args=[partition, expected, end]):
            raise RuntimeError(f"the mark of usage[{partition}] changed while it was caught "
                               "up (a Redis flush?)")
        self.live.add(partition)
        log.info("request index: usage[%d] %s to offset %d, %d records read in %.2f s",
                 partition, "rebuilt" if full else "caught up", end, count,
                 time.perf_counter() - started)

    async def _read(self, partition: int, start: int | None) -> tuple[int, int]:
        """Index the records of usage[partition] from ``start`` (from the
        retention's start when None) to its end offset as the read begins;
        that end offset and how many records were read."""
        tp = TopicPartition(self.topic, partition)
        consumer = make_consumer(self.settings.kafka, group=None)
        try:
            await consumer.start()
            consumer.assign([tp])
            end = int((await consumer.end_offsets([tp]))[tp])
            if start is None:
                since = self.clock() - self.writer.retention_ms
                hit = (await consumer.offsets_for_times({tp: since}))[tp]
                start = end if hit is None else int(hit.offset)
            consumer.seek(tp, start)
            position, count = start, 0
            while position < end:
                batch = await consumer.getmany(tp, timeout_ms=500)
                rows = []
                for record in batch.get(tp, []):
                    position = record.offset + 1
                    if record.offset >= end:
                        break
                    count += 1
                    try:
                        rows.append(RequestRow.of(self.codec.decode(record.value,
                                                                    "UsageRecord")))
                    except Exception:  # a poison value holds no request; the app dead-letters it
                        continue
                await self.writer.write(rows)
                # past any offset that holds no record
                position = max(position, await consumer.position(tp))
            return end, count
        except BROKER_TROUBLE as exc:
            raise RuntimeError(f"cannot read usage[{partition}]: {exc!r}") from exc
        finally:
            await stop_consumer(consumer, 5.0)

