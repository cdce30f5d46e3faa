"""Whether a task is a first attempt or a retry, and where a retry continues.

The tokens a client has seen are in ``conveyor.tokens``, the record
(docs/decisions/0001-the-log-is-the-record.md). Redis holds a *claim* per task
(``started:<worker>``, then ``done:<worker>``) and a short *lease*, renewed
while the task runs, that tells a duplicate (wait) from a retry (continue).
A claim Redis *creates* means "never started" only for a task written after
Redis's epoch (stamped the first time it is missing), after this worker last
saw Redis fail or restart, and after it started, each with ``clock_skew_ms``
to spare; any other task is looked up in ``conveyor.tokens`` and its chunks
added up by :class:`~workers.chunk_order.ChunkOrder`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from conveyor.errors import BrokerError, TransientBrokerError
from conveyor.redis_clients import REDIS_ERRORS, Redis
from conveyor.settings import Settings
from schemas.records import TokenChunk
from topics.catalog import TOKENS
from topics.envelope import now_ms
from topics.lookup import SharedLookup
from workers.chunk_order import ChunkOrder

__all__ = ["Progress", "ProgressTracker", "progress_of", "Claim"]

log = logging.getLogger(__name__)

_DONE = b"done:"
_STARTED = b"started:"
_READ_TIMEOUT_S = 10.0

# claim, lease and Redis's epoch in one round trip; the epoch is stamped with
# Redis's own clock the first time it is missing (after a flush or a restart
# that lost the data set). A lease the claiming worker holds already is its
# own: a run that Kafka interrupted claims its task again while the worker
# still renews its lease, and must not wait for itself.
_CLAIM = """
local epoch = redis.call('GET', KEYS[3])
if not epoch then
  local t = redis.call('TIME')
  epoch = tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
  redis.call('SET', KEYS[3], epoch)
end
local created = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
local state = redis.call('GET', KEYS[1])
local leased = redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4])
if not leased and redis.call('GET', KEYS[2]) == ARGV[3] then
  leased = redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
end
return {created and 1 or 0, state, leased and 1 or 0, epoch}
"""

Claim = Literal["start", "done", "busy"]


@dataclass(frozen=True)
class Progress:
    next_seq: int = 0
    text: str = ""
    tokens: int = 0
    finished: bool = False


def progress_of(chunks: list[TokenChunk]) -> Progress:
    """What the chunks of one request (in log order) add up to, by the rule
    postprocess answers with (:class:`~workers.chunk_order.ChunkOrder`)."""
    order = ChunkOrder()
    text: list[str] = []
    tokens, finished = 0, False
    for chunk in chunks:
        for ready in order.offer(chunk):
            text.append(ready["text"])
            tokens += ready["tokens"]
            if ready["finish_reason"] is not None or ready["error"] is not None:
                finished = True
                break
        if finished:
            break
    return Progress(order.next_seq, "".join(text), tokens, finished)


class ProgressTracker:
    def __init__(self, settings: Settings, redis: Redis, lookup: SharedLookup) -> None:
        self.settings = settings
        self.redis = redis
        self.lookup = lookup  # the worker's: it reads the request's partition of tokens
        # tasks written before this are looked up in the log whatever Redis says
        self.distrust_before_ms = now_ms()
        self.redis_ok = True
        self._redis_run_id: str | None = None
        self._epoch_key = f"{settings.kafka.topic_prefix}:redis-epoch"
        # EVALSHA, the script sent again only when Redis lost it (a flush, a restart)
        self._claim = redis.register_script(_CLAIM)

    def _key(self, request_id: str) -> str:
        return f"{self.settings.kafka.topic_prefix}:claim:{request_id}"

    def _lease(self, request_id: str) -> str:
        return f"{self.settings.kafka.topic_prefix}:lease:{request_id}"

    def redis_failed(self, exc: BaseException) -> None:
        """Redis failed underneath: claims written around now may be lost."""
        if self.redis_ok:
            log.warning("redis unreachable (%s): retries are decided from the log", exc)
        self.redis_ok = False
        self.distrust_before_ms = now_ms()

    def _redis_answered(self) -> None:
        if not self.redis_ok:
            log.info("redis answers again")
            self.redis_ok = True
            self.distrust_before_ms = now_ms()

    async def check_redis(self) -> None:
        """Notice a restart of Redis (a new run id): what it held may be older."""
        try:
            info = await self.redis.info("server")
        except REDIS_ERRORS as exc:
            self.redis_failed(exc)
            return
        self._redis_answered()
        run_id = str(info.get("run_id", ""))
        if self._redis_run_id is not None and run_id != self._redis_run_id:
            log.warning("redis restarted: retries of older tasks are decided from the log")
            self.distrust_before_ms = now_ms()
        self._redis_run_id = run_id

    async def claim(self, request_id: str, worker_id: str, written_ms: int,
                    entered_ms: int) -> tuple[Claim, Progress]:
        """Take the task's lease and say where to start: ``start`` with the
        progress to continue from (empty for a first attempt), ``done`` (it
        ended before; only its offset was left to commit) or ``busy`` (another
        worker holds the lease: a duplicate of a running task). ``written_ms``
        is when the task was written to its topic, ``entered_ms`` when the
        request entered the gateway."""
        try:
            created, state, leased, epoch = await self._claim(
                keys=[self._key(request_id), self._lease(request_id), self._epoch_key],
                args=[_STARTED + worker_id.encode(), self.settings.infer.progress_ttl_s, worker_id,
                      int(self.settings.infer.claim_lease_s * 1000)])
        except REDIS_ERRORS as exc:
            self.redis_failed(exc)
        else:
            self._redis_answered()
            if isinstance(state, bytes) and state.startswith(_DONE):
                return "done", Progress(finished=True)
            if not leased:
                return "busy", Progress()
            trusted_from = max(int(epoch),
                               self.distrust_before_ms) + self.settings.process.clock_skew_ms
            if created and written_ms >= trusted_from:
                return "start", Progress()
        progress = await self.recover(request_id, entered_ms)
        return ("done" if progress.finished else "start"), progress

    async def keep(self, request_ids: list[str], worker_id: str) -> None:
        """Renew the leases of the tasks this worker runs."""
        if not request_ids:
            return
        lease_ms = int(self.settings.infer.claim_lease_s * 1000)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for rid in request_ids:
                    pipe.set(self._lease(rid), worker_id, px=lease_ms)
                await pipe.execute()
        except REDIS_ERRORS as exc:
            self.redis_failed(exc)

    async def release(self, request_id: str) -> None:
        """Give the lease up (the task was handed off): its next owner need not wait."""
        try:
            await self.redis.delete(self._lease(request_id))
        except REDIS_ERRORS as exc:
            self.redis_failed(exc)

    async def finish(self, request_id: str, worker_id: str) -> None:
        """Record that the task ended and every chunk of it is in the log."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(self._key(request_id), _DONE + worker_id.encode(),
                         ex=self.settings.infer.progress_ttl_s)
                pipe.delete(self._lease(request_id))
                await pipe.execute()
        except REDIS_ERRORS as exc:
            self.redis_failed(exc)  # a later redelivery finds the end in the log

    async def recover(self, request_id: str, entered_ms: int) -> Progress:
        """Read back what earlier runs put on ``conveyor.tokens``."""
        since = max(0, entered_ms - self.settings.process.clock_skew_ms)
        try:
            found = await self.lookup.find(TOKENS, request_id, since,
                                           timeout_s=_READ_TIMEOUT_S)
        except BrokerError as exc:
            raise TransientBrokerError(f"cannot read {request_id}'s tokens: {exc}") from exc
        # a chunk that does not decode was reported and left out: the answer
        # continues after the chunks that do (ChunkOrder waits for none)
        chunks = [chunk for _, chunk in found]
        log.info("recovered %d chunks of %s from %s[%s]", len(chunks), request_id,
                 TOKENS.at(self.settings.kafka), found[0][0].partition if found else "-")
        return progress_of(chunks)
