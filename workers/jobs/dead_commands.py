"""A job whose command was dead-lettered ends ``failed`` instead of waiting for
ever: :class:`DeadLetters`, a layer on ``conveyor.dlq`` run by the jobs
layer's background :class:`DeadCommands`, fails the job a letter of the jobs
layer is keyed by while that job has not started (a batch ``validating``, a
background response ``queued``); a job past that runs to its end
(docs/decisions/0031-dead-job-commands.md).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from conveyor.errors import SchemaError, StartupTimeout, TransientBrokerError, last_line
from conveyor.settings import Settings
from schemas.codec import Codec
from schemas.records import DeadLetter, JobStatus
from topics.backoff import Backoff, RateLimitedLog
from topics.catalog import DLQ, JOB_STATUS, JOBS
from topics.clients import PRODUCE_TIMEOUT_MS
from topics.lookup import SharedLookup
from workers.layer import Layer, Record
from workers.outputs import Output, Sender, job_event
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


class DeadLetters(Layer):
    """The layer that follows ``conveyor.dlq`` and fails the jobs whose commands
    are there; see the module."""

    name = DEAD_COMMANDS_GROUP
    source = DLQ

    def __init__(self, settings: Settings, codec: Codec) -> None:
        self.settings = settings
        self.codec = codec
        # one reader: a dead command is rare
        self.lookup = SharedLookup(settings, readers=1, timeout_s=_LOOKUP_TIMEOUT_S,
                                   codec=codec)

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
