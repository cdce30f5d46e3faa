"""A job whose command was dead-lettered ends ``failed`` instead of waiting
for ever.

A record on ``conveyor.jobs`` that the jobs layer cannot decode (bad bytes, a
schema this Conveyor does not know) never reaches
:meth:`~workers.jobs.commands.JobsLayer.handle`: the runtime puts it in
``conveyor.dlq`` and moves on. Nothing else would end the job it belongs to:
a batch would stay ``validating`` and ``client.batches.retrieve`` would never
see it end. :class:`DeadCommands`, a background task of the jobs layer,
follows the DLQ and ends such jobs.

Decisions:

- **The DLQ is the record.** The runtime produces a letter, and waits for its
  acknowledgement, before the command's offset may be committed, so every
  command the layer gave up on is a letter there; following the DLQ sees each
  at least once, in its own consumer group (``<prefix>.jobs-dead-letters``,
  one member of the jobs layer reads it), committing a letter only once its
  job's failure is acknowledged. The same path ends a job whose command did
  decode but could not be handled or produced (a letter of the jobs layer
  either way). A fresh group starts at the DLQ's beginning: jobs stuck before
  this follower existed end too, and the state check below keeps it from
  touching any job that has moved on.
- **Which job.** The record's key is its job id. Its latest state is read
  from ``conveyor.job-status`` (where the gateway wrote it before the
  command; the layer's long-lived keyed lookup,
  :class:`~topics.lookup.SharedLookup`, reads from the command's time
  on, less the clock skew and the longest a producer holds a record before it
  lands, since a record's time is when it was sent, so only the traffic since
  then is read; the whole partition when nothing is found there). A letter
  without a key, or whose key names no job there, stays a dead letter alone:
  there is no job to end.
- **Only a job that has not started.** A batch still ``validating`` (a
  background response still ``queued``) fails. A job past that already had
  its create command carried out (the dead command was a later one, most
  likely a cancel): failing it would throw away answers in flight, so the
  dead letter alone is right and the job runs to its end. The folds apply the
  same rule (an ``invalid`` after ``expanded`` changes nothing), which closes
  the race with a state not yet published.
- **The failure is the layer's own.** An ``invalid`` event on
  ``conveyor.results``, as for a file that fails validation, with OpenAI's
  errors list: ``{"code": "invalid_command"`` (the value does not decode) or
  ``"command_failed"`` (it decodes; handling or producing failed)``,
  "line": null, "message", "param": null}``, and the job's object from its
  state, so the failed Batch keeps its endpoint, input file and metadata.
- **Idempotent.** A command read twice (a crash before its commit) is two
  letters; the second finds the job ``failed`` and does nothing, or, when the
  first failure is not yet published, sends ``invalid`` again, which the fold
  ignores (a final job takes no event).
- **On the layer runtime, not a loop of its own.** Following the DLQ is what
  a layer does: a consumer group on one source topic, an event decoded as
  the topic's type, outputs produced and acknowledged before the offset is
  committed (below the lowest unfinished letter), passing broker trouble
  retried with backoff on the same letter, letters of one job in order and
  of different jobs side by side (:data:`_CONCURRENCY` at a time, each
  reading ``conveyor.job-status``). So :class:`DeadLetters` is a
  :class:`~workers.layer.Layer` and :class:`DeadCommands` runs it on a
  :class:`~workers.runtime.LayerRuntime` of its own inside the jobs layer's
  process, on the jobs layer's producer: one more source in the process, no
  new process to deploy, and the group keeps its name so a running
  deployment goes on from its commits. The shared follower
  (:mod:`topics.follow`) was the other choice; it reads without a group, so
  the commits, the acknowledgements before them and the retries would have
  been written here again.
- **Never stuck, never skipping, never feeding itself.** Broker trouble
  (Kafka down, a lookup of ``conveyor.job-status`` timing out) is retried
  with backoff on the same letter, logged once per kind per ten seconds. What
  would make a layer dead-letter an event (a value that is not a
  DeadLetter, a failure that cannot be produced ever, a bug) is logged and
  the letter passed over: the runtime never dead-letters an event of the
  DLQ into the DLQ (workers/failures.py), or the DLQ would feed itself. The
  runtime's start is bounded (``startup_timeout_s``); when it gives up, or
  ends for any reason, it is started again after a backoff, from the last
  commit.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiokafka import TopicPartition

from conveyor.errors import SchemaError, StartupTimeout, TransientBrokerError, last_line
from conveyor.settings import Settings
from schemas.codec import Codec
from schemas.records import DeadLetter, JobStatus
from topics.backoff import Backoff, RateLimitedLog
from topics.catalog import DLQ, JOB_STATUS, JOBS
from topics.clients import PRODUCE_TIMEOUT_MS
from topics.lookup import SharedLookup
from workers.job_results import job_event
from workers.layer import Record
from workers.outputs import Output, Sender
from workers.runtime import LayerRuntime

__all__ = ["DEAD_COMMANDS_GROUP", "DeadCommands", "DeadLetters", "ended", "failure_event",
           "job_id_of", "job_state"]

log = logging.getLogger(__name__)

# the layer's name, and so its consumer group (<prefix>.jobs-dead-letters)
DEAD_COMMANDS_GROUP = "jobs-dead-letters"
# the states of a job whose create command has not been carried out
_NOT_STARTED = ("validating", "queued")
# the states a job never leaves (a batch's and a background response's)
_ENDED = ("completed", "failed", "cancelled", "expired", "incomplete")
_LOOKUP_TIMEOUT_S = 10.0
# letters of different jobs handled at a time (each reads conveyor.job-status)
_CONCURRENCY = 4


def job_id_of(settings: Settings, letter: DeadLetter) -> str | None:
    """The job a letter of the jobs layer is keyed by (None: not such a letter,
    or no key to name a job)."""
    if letter["layer"] != "jobs" or letter["topic"] != JOBS.at(settings.kafka):
        return None
    try:
        key = (letter["key"] or b"").decode()
    except UnicodeDecodeError:
        return None
    return key or None


def failure_event(settings: Settings, codec: Codec, letter: DeadLetter,
                  status: JobStatus | None) -> Output | None:
    """The ``invalid`` event that ends the job of ``letter`` given its latest
    ``status``, or None when the dead letter alone is right (see the module)."""
    job_id = job_id_of(settings, letter)
    if job_id is None or status is None or status["job_id"] != job_id:
        return None
    obj: dict[str, Any] = json.loads(status["object"])
    if obj.get("status") not in _NOT_STARTED:
        return None
    error = {"code": "", "line": None, "message": "", "param": None}
    try:
        codec.decode(letter["value"], "JobCommand")
    except SchemaError as exc:
        error["code"] = "invalid_command"
        error["message"] = (f"Conveyor could not read this job's command ({exc}); it was "
                            "set aside in the dead-letter topic.")
    else:
        error["code"] = "command_failed"
        why = last_line(letter["error"]) or "unknown error"
        error["message"] = (f"Conveyor could not carry out this job's command ({why}); it "
                            "was set aside in the dead-letter topic.")
    log.info("job %s: failed, its command is a dead letter (%s)", job_id, error["code"])
    return job_event(settings, job_id, "invalid", json.dumps(
        {"object": obj, "errors": [error], "tenant": status["tenant"]}))


class DeadLetters:
    """The layer that follows ``conveyor.dlq`` and fails the jobs whose commands
    are there; see the module."""

    name = DEAD_COMMANDS_GROUP
    source = DLQ

    def __init__(self, settings: Settings, codec: Codec) -> None:
        self.settings = settings
        self.codec = codec
        # the process's keyed lookup, kept for the layer's life (one reader: a
        # dead command is rare, and the runtime handles few letters at once)
        self.lookup = SharedLookup(settings, readers=1, timeout_s=_LOOKUP_TIMEOUT_S,
                                   codec=codec)

    async def start(self, sender: Sender) -> None:
        return None

    async def stop(self) -> None:
        await self.lookup.close()

    async def handle(self, letter: DeadLetter, record: Record) -> list[Output]:
        """The event that ends the letter's job, when it should end (none else)."""
        job_id = job_id_of(self.settings, letter)
        if job_id is None:
            return []
        try:
            status = await self.state(letter, job_id)
        except (OSError, TimeoutError) as exc:  # the lookup's broker did not answer
            raise TransientBrokerError(f"{type(exc).__name__}: {exc}") from exc
        out = failure_event(self.settings, self.codec, letter, status)
        if out is None:
            log.info("job %s: its command at %s[%d]@%d is a dead letter; the job goes on as "
                     "it is", job_id, letter["topic"], letter["partition"], letter["offset"])
            return []
        return [out]

    async def state(self, letter: DeadLetter, job_id: str) -> JobStatus | None:
        return await job_state(self.settings, self.codec, self.lookup, letter, job_id)

    def committable(self, tp: TopicPartition, next_offset: int) -> int:
        return next_offset

    def revoked(self, partitions: list[TopicPartition]) -> None:
        return None


class DeadCommands:
    """The jobs layer's background task: :class:`DeadLetters` on a runtime of its
    own, on the jobs layer's producer, started again whenever it ends."""

    def __init__(self, settings: Settings, sender: Sender) -> None:
        self.settings = settings
        self.sender = sender
        self._problems = RateLimitedLog(log)

    def runtime(self) -> LayerRuntime:
        return LayerRuntime(self.settings, DeadLetters(self.settings, self.sender.codec),
                            codec=self.sender.codec, producer=self.sender.producer,
                            max_concurrency=_CONCURRENCY)

    async def run(self) -> None:
        """Follow for ever (until cancelled); see the module for what is retried."""
        backoff = Backoff(max_s=self.settings.process.retry_backoff_max_s)
        while True:
            try:
                await self.runtime().run()
            except (StartupTimeout, TransientBrokerError) as exc:
                self._problems.warning("start", "dead commands: cannot follow %s (%s); "
                                       "retrying", DLQ.at(self.settings.kafka), exc)
            except Exception:
                log.exception("dead commands: following %s failed; starting again from the "
                              "last commit", DLQ.at(self.settings.kafka))
            await backoff.wait()


async def job_state(settings: Settings, codec: Codec, lookup: SharedLookup,
                    letter: DeadLetter, job_id: str) -> JobStatus | None:
    """The latest state on ``conveyor.job-status`` of the job a letter of the
    jobs layer names, read from the time its command was written (the whole
    topic when that record is gone)."""
    command = await lookup.at(letter["topic"], letter["partition"], letter["offset"])
    # the status was acknowledged before the command was sent, but its time is
    # when it was sent: a producer waiting out a leaderless partition (a broker
    # restarting) holds it up to PRODUCE_TIMEOUT_MS first
    skew = settings.process.clock_skew_ms
    since = command.timestamp - skew - PRODUCE_TIMEOUT_MS if command else 0
    found = await lookup.find(JOB_STATUS, job_id, since)
    if not found and since > 0:
        # none in the window (a clock further off than the settings say):
        # the whole partition, as when the command is gone; a dead command is rare
        found = await lookup.find(JOB_STATUS, job_id, 0)
    return max((status for _, status in found), key=lambda s: s["version"], default=None)


def ended(status: JobStatus | None) -> str | None:
    """The final status of a job that has ended (a batch or a background
    response), None while it has not."""
    state = json.loads(status["object"]).get("status") if status is not None else None
    return state if state in _ENDED else None
