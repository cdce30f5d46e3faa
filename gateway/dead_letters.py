"""Dead letters: read from ``conveyor.dlq``, checked, and redriven to where they
came from, each redrive recorded on ``conveyor.audit`` (what is refused
without ``force``: docs/operating/log-tools.md). ``conveyor dlq`` and the
console act through these functions. A letter is named by its offset."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.errors import SchemaError
from conveyor.settings import Settings
from gateway.audit import Audit, audit_event
from schemas.codec import Codec, EventType, default_codec
from schemas.records import AuditEvent, DeadLetter
from topics.catalog import AUDIT, DLQ, infer_topic, topic_named
from topics.clients import make_producer
from topics.envelope import iso
from topics.lookup import KeyLookup
from topics.reader import decoded
from workers.journey import find_journey
from workers.outputs import batch_output

__all__ = ["REDRIVE_ACTION", "Letter", "Redriven", "check", "event_type_of", "read_letters",
           "redriven", "redrive"]

REDRIVE_ACTION = "dlq.redrive"
_TRUNCATED = "[value truncated"


@dataclass(frozen=True)
class Letter:
    offset: int
    letter: DeadLetter

    @property
    def source(self) -> str:
        d = self.letter
        return f"{d['topic']}[{d['partition']}]@{d['offset']}"


@dataclass(frozen=True)
class Redriven:
    offset: int
    sent: bool
    detail: str  # where it went, or why not


def event_type_of(settings: Settings, topic: str) -> EventType | None:
    """The event type a Conveyor topic carries (None for one it does not know)."""
    if topic.startswith(infer_topic(settings.kafka, "")):
        return "Task"
    declared = topic_named(settings.kafka, topic)
    return declared.events[0] if declared is not None and len(declared.events) == 1 else None


async def read_letters(settings: Settings, since_ms: int, offsets: list[int] | None = None,
                       codec: Codec | None = None) -> list[Letter]:
    """The letters written since ``since_ms``, or those at ``offsets``."""
    codec = codec or default_codec()
    topic = DLQ.at(settings.kafka)
    async with KeyLookup(settings) as look:
        if offsets is None:
            records = await look.find(topic, None, since_ms, partitions=[0])
        else:
            found = [await look.at(topic, 0, o) for o in offsets]
            records = [r for r in found if r is not None]
    return [Letter(r.offset, DLQ.decode(codec, r.value)) for r in records]


async def redriven(settings: Settings, since_ms: int, codec: Codec | None = None
                   ) -> dict[int, AuditEvent]:
    """The letters sent back since ``since_ms``: DLQ offset -> its audit event."""
    codec = codec or default_codec()
    dlq = DLQ.at(settings.kafka)
    out: dict[int, AuditEvent] = {}
    async with KeyLookup(settings) as look:
        records = await look.find(AUDIT.at(settings.kafka), None, since_ms, partitions=[0])
    # another writer's event this reader cannot read is passed over
    for _, event in decoded(AUDIT, codec, records, lambda record, exc: None):
        if event["action"] == REDRIVE_ACTION and event["detail"].get("dlq") == dlq:
            out.setdefault(int(event["detail"]["dlq_offset"]), event)
    return out


def check(settings: Settings, codec: Codec, letter: DeadLetter) -> str | None:
    """Why ``letter`` cannot be sent back as it is (None: it can)."""
    if letter["value"] is None:
        return "the letter has no value"
    event_type = event_type_of(settings, letter["topic"])
    if event_type is None:
        return None
    try:
        codec.decode(letter["value"], event_type)
    except Exception as exc:
        return f"its value still does not decode as a {event_type}: {exc}"
    return None


async def _job_ended(settings: Settings, codec: Codec, letter: DeadLetter) -> str | None:
    """Why a jobs-layer letter is not sent back: its job has ended, so a create
    command would run its lines while the job shows it ended (None: it has not)."""
    from topics.lookup import SharedLookup
    from workers.jobs.dead_commands import ended, job_id_of, job_state

    job_id = job_id_of(settings, letter)
    if job_id is None:
        return None
    lookup = SharedLookup(settings, readers=1, codec=codec)
    try:
        state = ended(await job_state(settings, codec, lookup, letter, job_id))
    finally:
        await lookup.close()
    if state is None:
        return None
    return (f"its job {job_id} has ended ({state}): its lines would run unseen; create the "
            "job again (--force to send it anyway)")


# how long before its letter a request is looked for, to see whether it was answered
_ANSWER_LOOKBACK_MS = 86_400_000


async def _answered(settings: Settings, codec: Codec, letter: DeadLetter) -> str | None:
    """Why a letter whose request has its answer in the log (an error reply,
    most often, sent when the layer gave up on it) is not sent back: handled
    again, the request would be answered twice (None: no answer found)."""
    if letter["key"] is None or event_type_of(settings, letter["topic"]) is None:
        return None
    request_id = letter["key"].decode(errors="replace")
    journey = await find_journey(settings, request_id, letter["ts_ms"] - _ANSWER_LOOKBACK_MS,
                                 codec)
    answers = [f for f in journey.replies if f.record and f.record.get("kind") != "delta"] \
        if journey is not None else []
    if not answers:
        return None
    return (f"its request {request_id} was answered already ({answers[0].where}): sent "
            "back, it would be answered twice (--force to send it anyway)")


def _headers(settings: Settings, codec: Codec, letter: DeadLetter
             ) -> list[tuple[str, bytes]] | None:
    """The headers a record of many requests' events was written with (its
    request ids, and what it ends), made again from its value: the letter
    keeps key, value and partition only."""
    topic = topic_named(settings.kafka, letter["topic"])
    if topic is None or topic.batch is None:
        return None
    try:
        events = topic.unpack(codec, letter["value"])
    except SchemaError:
        return None
    return list(batch_output(settings.kafka, topic, events, letter["partition"]).headers)


async def redrive(settings: Settings, letters: list[Letter], actor: str, *,
                  force: bool = False, codec: Codec | None = None) -> list[Redriven]:
    """Send each letter's key and value back to its topic and partition, and
    record it; see the module for what is refused."""
    codec = codec or default_codec()
    done = await redriven(settings, min((x.letter["ts_ms"] for x in letters), default=0),
                          codec) if letters else {}
    results: list[Redriven] = []
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        audit = Audit(settings, producer, codec, actor=actor)
        for x in letters:
            d = x.letter
            if d["error"].startswith(_TRUNCATED):
                results.append(Redriven(x.offset, False, "its value was truncated in the DLQ"))
                continue
            if x.offset in done and not force:
                results.append(Redriven(x.offset, False, "already redriven at "
                                        f"{iso(done[x.offset]['ts_ms'])} (--force to resend)"))
                continue
            problem = check(settings, codec, d)
            if problem is None and not force:
                problem = await _job_ended(settings, codec, d) or await _answered(
                    settings, codec, d)
            if problem is not None and (not force or d["value"] is None):
                results.append(Redriven(x.offset, False, problem))
                continue
            meta = await producer.send_and_wait(d["topic"], d["value"], key=d["key"],
                                                partition=d["partition"],
                                                headers=_headers(settings, codec, d))
            where = f"{d['topic']}[{meta.partition}]@{meta.offset}"
            key = (d["key"] or b"").decode(errors="replace")
            await audit.write(audit_event(REDRIVE_ACTION, request_id=key, detail={
                "dlq": DLQ.at(settings.kafka), "dlq_offset": str(x.offset),
                "layer": d["layer"], "source": x.source, "sent_to": where}))
            results.append(Redriven(x.offset, True, where))
    finally:
        await producer.stop()
    return results
