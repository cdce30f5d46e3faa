"""What a layer's handler asks the runtime to produce, and the error replies,
job results and dead letters every layer sends the same way.

:meth:`Sender.produce` is the one way an event's outputs reach Kafka with a
verdict: it returns once every output is acknowledged, retries what failed
for a passing reason (with backoff, never dead-lettered: the event is fine)
and raises :class:`PermanentBrokerError` (:class:`EventTooLarge` for size) or
:class:`SchemaError` for what will never go through.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import (
    PermanentBrokerError,
    PipelineUnavailable,
    RequestError,
    RequestTooLarge,
    SchemaError,
    TransientBrokerError,
)
from conveyor.settings import KafkaSettings, Settings
from schemas.codec import Codec, EventType
from schemas.records import (
    DeadLetter,
    Envelope,
    ErrorInfo,
    Generation,
    JobResult,
    Reply,
    Usage,
    UsageRecord,
)
from topics.backoff import Backoff, RateLimitedLog
from topics.catalog import DLQ, REPLIES, RESULTS, TOKENS, TOPICS, USAGE, Topic
from topics.clients import EventTooLarge, broker_error
from topics.envelope import now_ms
from topics.lookup import key_partition
from topics.producer import Producer
from topics.reader import ended_ids_header, request_ids_header

__all__ = ["Output", "RECORD_MARGIN", "Sender", "event_bytes", "dead_letter_record",
           "error_info", "failure_reply", "job_event", "result_output", "usage_output"]

log = logging.getLogger(__name__)

# Room a dead letter keeps for its own fields, the error and the record framing.
_LETTER_OVERHEAD = 16 * 1024
_ERROR_CHARS = 4000


@dataclass(frozen=True)
class Output:
    topic: str
    event_type: EventType
    record: Any
    key: str | None = None
    partition: int | None = None
    headers: tuple[tuple[str, bytes], ...] = ()


def usage_output(settings: Settings, envelope: Envelope, *, status: str, model: str,
                 kind: str, prompt_tokens: int = 0, completion_tokens: int = 0,
                 first_token_ms: int | None = None, error_code: str | None = None,
                 asked_model: str = "") -> Output:
    """What a request cost, for the usage ledger and the request index
    (``conveyor.usage``, key = tenant): written by postprocess as a request
    ends, and by the layer that refuses one (no token, the error's code)."""
    finished = now_ms()
    entered_us = envelope["stamps"].get("gateway")
    record = UsageRecord(
        request_id=envelope["request_id"], tenant=envelope["tenant"],
        key_id=envelope["key_id"], model=model, kind=kind, status=status,
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        entered_ms=entered_us // 1000 if entered_us is not None else finished,
        finished_ms=finished, first_token_ms=first_token_ms, error_code=error_code,
        asked_model=asked_model)
    return Output(USAGE.at(settings.kafka), "UsageRecord", record, key=envelope["tenant"])


def result_output(settings: Settings, envelope: Envelope, *, status_code: int,
                  body: str = "", error: ErrorInfo | None = None, text: str = "",
                  finish_reason: str | None = None, usage: Usage | None = None) -> Output:
    """How a job's request ends, instead of a reply to a gateway: one
    :class:`~schemas.records.JobResult` on ``conveyor.results`` (key = job
    id), for an answer and an error alike, so the job's collector
    (:mod:`workers.jobs.collector`) reads it in order with the job's own events."""
    result = JobResult(job_id=envelope["job_id"], event="result",
                       request_id=envelope["request_id"], job_item=envelope["job_item"],
                       status_code=status_code, body=body, error=error, text=text,
                       finish_reason=finish_reason, usage=usage, detail="", ts_ms=now_ms())
    return Output(RESULTS.at(settings.kafka), "JobResult", result, key=envelope["job_id"])


def batch_output(kafka: KafkaSettings, topic: Topic[Any], events: list[Any],
                 partition: int) -> Output:
    """One record of ``topic`` holding ``events`` of several requests (in
    order), on ``partition``, their requests named in its request-ids header
    (and, on conveyor.tokens, those it ends in its ended-ids header)."""
    headers = [request_ids_header(e["envelope"]["request_id"] for e in events)]
    if topic is TOKENS:
        headers.append(ended_ids_header(
            e["envelope"]["request_id"] for e in events
            if e["finish_reason"] is not None or e["error"] is not None))
    return Output(topic.at(kafka), topic.events[0], topic.pack(events), partition=partition,
                  headers=tuple(headers))


def packed(kafka: KafkaSettings, outputs: list[Output]) -> list[Output]:
    """``outputs`` with the events bound for a topic of batches (tokens,
    replies) gathered into one record a partition, placed where the first of
    them was; the others as they are. Order within a partition is kept. A
    record that would outgrow ``max_event_bytes`` (large answers: embeddings)
    is closed and the next one begun after it."""
    batched = _batched(kafka.topic_prefix)
    if not any(o.topic in batched for o in outputs):
        return outputs
    room = kafka.max_event_bytes - RECORD_MARGIN
    out: list[Output | tuple[Topic[Any], int, int]] = []
    groups: dict[tuple[str, int, int], list[Any]] = {}
    open_group: dict[tuple[str, int], tuple[int, int]] = {}  # -> (group number, bytes)
    for o in outputs:
        topic = batched.get(o.topic)
        if topic is None or o.event_type == topic.events[0]:
            out.append(o)
            continue
        partition = o.partition if o.partition is not None else key_partition(
            (o.key or "").encode(), topic.partitions(kafka))
        size = event_bytes(o.record)
        number, used = open_group.get((o.topic, partition), (-1, 0))
        if number < 0 or used + size > room:
            number, used = number + 1, 0
            groups[(o.topic, partition, number)] = []
            out.append((topic, partition, number))
        groups[(o.topic, partition, number)].append(o.record)
        open_group[(o.topic, partition)] = (number, used + size)
    return [o if isinstance(o, Output) else
            batch_output(kafka, o[0], groups[(o[0].at(kafka), o[1], o[2])], o[1]) for o in out]


# what a record of batched events holds besides its events' large fields, at most
RECORD_MARGIN = 64 * 1024


def event_bytes(event: Any) -> int:
    """About the bytes an event of a batch takes: its large fields (a reply's
    text and chunk objects, a chunk's text and vectors) and 2 KB for the rest."""
    return (2048 + len(event.get("text") or "") + len(event.get("chunk") or "")
            + sum(len(e["vector"]) + 8 for e in event.get("embeddings") or ()))


@functools.lru_cache(maxsize=64)
def _batched(topic_prefix: str) -> dict[str, Topic[Any]]:
    """The topics of batches by full name (keyed by the prefix: a string hashes
    cheaply, the settings' dataclass field by field on every output)."""
    return {f"{topic_prefix}.{t.name}": t for t in TOPICS if t.batch is not None}


def job_event(settings: Settings, job_id: str, event: str, detail: str = "") -> Output:
    """A job-level event (expanded, invalid, cancel) in the job's results stream."""
    record = JobResult(job_id=job_id, event=event, request_id="", job_item="",  # type: ignore[typeddict-item]
                       status_code=0, body="", error=None, text="", finish_reason=None,
                       usage=None, detail=detail, ts_ms=now_ms())
    return Output(RESULTS.at(settings.kafka), "JobResult", record, key=job_id)


def error_info(exc: RequestError) -> ErrorInfo:
    return ErrorInfo(
        status=exc.status, type=exc.type, code=exc.code, param=exc.param, message=exc.message
    )


def failure_reply(exc: BaseException, layer: str) -> RequestError:
    """The error a client sees when its event could not be handled or produced."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, EventTooLarge):
        return RequestTooLarge(
            f"The request is too large for the pipeline: an event of it exceeded the "
            f"largest event Conveyor carries ({layer}). Send a shorter request.")
    if isinstance(exc, TransientBrokerError):
        return PipelineUnavailable("The pipeline is unavailable; try again later.")
    return RequestError(f"internal error in {layer}: {exc}")


def _headers(out: Output) -> list[tuple[str, bytes]] | None:
    """The output's own headers, and the W3C trace context for an event that
    belongs to a request."""
    envelope = out.record.get("envelope") if isinstance(out.record, dict) else None
    headers = [*out.headers, ("traceparent", envelope["traceparent"].encode())] if envelope \
        else list(out.headers)
    return headers or None


@dataclass
class Sender:
    """Encodes and produces outputs."""

    settings: Settings
    producer: Producer
    codec: Codec
    problems: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))

    async def send_nowait(self, out: Output) -> asyncio.Future[Any]:
        """Produce one output (an event of a topic of batches in a record of its
        own); the caller owns (and awaits) its acknowledgement."""
        out = packed(self.settings.kafka, [out])[0]
        try:
            value = self.codec.encode(out.event_type, out.record)
        except SchemaError:
            raise
        except Exception as exc:  # a record the schema cannot hold, in any shape
            raise SchemaError(f"cannot encode {out.event_type}: {exc!r}") from exc
        key = out.key.encode() if out.key is not None else None
        fut: asyncio.Future[Any] = await self.producer.send(
            out.topic, value, key=key, partition=out.partition, headers=_headers(out))
        return fut

    async def deliver(self, out: Output) -> None:
        """Produce one output and wait for its acknowledgement alone."""
        await (await self.send_nowait(out))

    async def produce(self, outputs: list[Output],
                      stopping: asyncio.Event | None = None) -> None:
        """Produce ``outputs`` and wait for every acknowledgement.

        An output that fails for a passing reason is sent again after a
        backoff (until ``stopping`` is set: then the transient error is
        raised and the event stays uncommitted). The outputs before one that
        can never be produced may have gone out (consumers are idempotent on
        request id).
        """
        backoff = Backoff(max_s=self.settings.process.retry_backoff_max_s)
        todo = packed(self.settings.kafka, outputs)
        while todo:
            acks: list[tuple[Output, asyncio.Future[Any] | Exception]] = []
            for out in todo:
                try:
                    acks.append((out, await self.send_nowait(out)))
                except SchemaError:
                    raise
                except Exception as exc:
                    acks.append((out, exc))
            failed: list[Output] = []
            for out, ack in acks:
                try:
                    if isinstance(ack, Exception):
                        raise ack
                    await ack
                    continue
                except Exception as error:
                    translated = broker_error(error)
                    if isinstance(translated, PermanentBrokerError):
                        raise translated from error
                    self.problems.warning(
                        f"produce:{type(error).__name__}",
                        "producing to %s failed for now, retrying: %s", out.topic, translated)
                    if stopping is not None and stopping.is_set():
                        raise translated from error
                failed.append(out)
            todo = failed
            if todo:
                await backoff.wait()

    def error_outputs(self, envelope: Envelope, exc: RequestError,
                      generation: Generation | None = None) -> list[Output]:
        """The reply that fails one request with ``exc`` (the result of a job's
        request), and its usage record (what was asked, ``generation``, when the
        layer read it), or none for a request without a reply address (a replay)."""
        error = error_info(exc)
        refused = usage_output(self.settings, envelope, status="error",
                               model=generation["model"] if generation else "",
                               kind=generation["kind"] if generation else "chat",
                               error_code=error["code"])
        if envelope.get("job_id"):
            return [result_output(self.settings, envelope, status_code=error["status"],
                                  error=error), refused]
        if envelope["reply_partition"] < 0:
            return []
        reply = Reply(envelope=envelope, index=0, kind="error", text="", chunk="",
                      finish_reason=None, usage=None, error=error)
        return [Output(REPLIES.at(self.settings.kafka), "Reply", reply,
                       key=envelope["request_id"], partition=envelope["reply_partition"]),
                refused]

    def letter_output(self, layer: str, topic: str, partition: int, offset: int,
                      key: bytes | None, value: bytes | None, error: str) -> Output:
        """The dead letter of a record (:func:`dead_letter_record`) on ``conveyor.dlq``."""
        letter = dead_letter_record(self.settings.kafka, layer, topic, partition, offset, key,
                                    value, error)
        return Output(DLQ.at(self.settings.kafka), "DeadLetter", letter,
                      key=key.decode(errors="replace") if key else None)


def dead_letter_record(kafka: KafkaSettings, layer: str, topic: str, partition: int,
                       offset: int, key: bytes | None, value: bytes | None,
                       error: str) -> DeadLetter:
    """A dead letter that fits in one event: a value too large keeps its head,
    and the error says how much was cut."""
    room = max(0, kafka.max_event_bytes - _LETTER_OVERHEAD)
    if value is not None and len(value) > room:
        error = (f"[value truncated to {room} of {len(value)} bytes] " + error)
        value = value[:room]
    return DeadLetter(layer=layer, topic=topic, partition=partition, offset=offset, key=key,
                      value=value, error=error[:_ERROR_CHARS], ts_ms=now_ms())
