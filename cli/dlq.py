"""``conveyor dlq``: list dead letters with their errors, show one, and redrive
them to where they came from (recorded on ``conveyor.audit``). A letter is
named by its offset in ``conveyor.dlq``; usage and what a redrive refuses
without ``--force``: docs/operating/log-tools.md."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass

from cli.text import fail
from conveyor.errors import SchemaError, last_line
from conveyor.settings import Settings
from schemas.codec import Codec, EventType, default_codec, plain
from schemas.records import AuditEvent, DeadLetter
from topics.catalog import AUDIT, DLQ, infer_topic, topic_named
from topics.envelope import iso
from topics.lookup import KeyLookup, parse_since
from topics.reader import decoded
from workers.outputs import batch_output

__all__ = ["Letter", "Redriven", "event_type_of", "read_letters", "redriven", "redrive",
           "register"]

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


def _check(settings: Settings, codec: Codec, letter: DeadLetter) -> str | None:
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


async def redrive(settings: Settings, letters: list[Letter], *, force: bool = False,
                  codec: Codec | None = None) -> list[Redriven]:
    """Send each letter's key and value back to its topic and partition, and
    record it; see the module for what is refused."""
    from gateway.audit import Audit, audit_event, cli_actor
    from topics.clients import make_producer

    codec = codec or default_codec()
    done = await redriven(settings, min((x.letter["ts_ms"] for x in letters), default=0),
                          codec) if letters else {}
    results: list[Redriven] = []
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        audit = Audit(settings, producer, codec, actor=cli_actor())
        for x in letters:
            d = x.letter
            if d["error"].startswith(_TRUNCATED):
                results.append(Redriven(x.offset, False, "its value was truncated in the DLQ"))
                continue
            if x.offset in done and not force:
                results.append(Redriven(x.offset, False, "already redriven at "
                                        f"{iso(done[x.offset]['ts_ms'])} (--force to resend)"))
                continue
            problem = _check(settings, codec, d)
            if problem is None and not force:
                problem = await _job_ended(settings, codec, d)
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


def _of_layer(settings: Settings, since: int, layer: str | None) -> list[Letter]:
    return [x for x in asyncio.run(read_letters(settings, since))
            if layer is None or x.letter["layer"] == layer]


def _cmd_list(settings: Settings, args: argparse.Namespace, since: int) -> int:
    letters = _of_layer(settings, since, args.layer)
    sent = asyncio.run(redriven(settings, since)) if letters else {}
    if args.json:
        print(json.dumps([{"offset": x.offset, "time": iso(x.letter["ts_ms"]),
                           "layer": x.letter["layer"], "source": x.source,
                           "key": (x.letter["key"] or b"").decode(errors="replace"),
                           "redriven": x.offset in sent, "error": last_line(x.letter["error"])}
                          for x in letters], indent=2))
        return 0
    if not letters:
        print(f"no dead letters since {iso(since)}")
    for x in letters:
        key = (x.letter["key"] or b"").decode(errors="replace")
        mark = "  [redriven]" if x.offset in sent else ""
        print(f"{x.offset:>6}  {iso(x.letter['ts_ms'])}  {x.letter['layer']:<11} "
              f"{x.source}  {key}{mark}  {last_line(x.letter['error'])}")
    return 0


def _cmd_show(settings: Settings, args: argparse.Namespace) -> int:
    codec = default_codec()
    found = asyncio.run(read_letters(settings, 0, args.offsets[:1]))
    if not args.offsets or not found:
        return fail(f"conveyor dlq: no letter at offset {args.offsets[:1]}", 1)
    x = found[0]
    d = x.letter
    sent = asyncio.run(redriven(settings, d["ts_ms"])).get(x.offset)
    value = d["value"] or b""
    print(f"letter {x.offset} of {settings.kafka.topic('dlq')}, written {iso(d['ts_ms'])}")
    print(f"layer    {d['layer']}\nsource   {x.source}")
    print(f"key      {(d['key'] or b'').decode(errors='replace')}")
    print(f"value    {len(value)} bytes, schema fingerprint {value[2:10].hex() or '-'}")
    problem = _check(settings, codec, d)
    print("decodes  " + ("yes, it can be redriven" if problem is None else f"no: {problem}"))
    if sent is not None:
        print(f"redriven {iso(sent['ts_ms'])} by {sent['actor']} to {sent['detail']['sent_to']}")
    print("error:\n" + d["error"].rstrip())
    event_type = event_type_of(settings, d["topic"])
    if args.show_content and problem is None and event_type is not None:
        print("event:\n" + json.dumps(plain(codec.decode(value, event_type)), indent=2,
                                      ensure_ascii=False))
    return 0


def cmd_dlq(settings: Settings, args: argparse.Namespace) -> int:
    try:
        since = parse_since(args.since)
    except ValueError as exc:
        return fail(f"conveyor dlq: {exc}")
    if args.action == "list":
        return _cmd_list(settings, args, since)
    if args.action == "show":
        return _cmd_show(settings, args)
    if args.all == bool(args.offsets):
        return fail("conveyor dlq redrive: name letters by OFFSET, or --all (with --layer)")
    if args.all:
        letters = _of_layer(settings, since, args.layer)
    else:
        letters = asyncio.run(read_letters(settings, 0, args.offsets))
        missing = set(args.offsets) - {x.offset for x in letters}
        if missing:
            return fail(f"conveyor dlq: no letter at offset(s) {sorted(missing)}", 1)
    results = asyncio.run(redrive(settings, letters, force=args.force))
    for r in results:
        print(f"{r.offset:>6}  " + (f"redriven to {r.detail}" if r.sent
                                    else f"not redriven: {r.detail}"))
    return 0 if all(r.sent for r in results) else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("dlq", help="dead letters: list, show, send back once fixed",
                       description="Letters are named by their offset in the DLQ topic; "
                                   "list and --all read it from --since on.")
    p.add_argument("action", choices=["list", "show", "redrive"])
    p.add_argument("offsets", nargs="*", type=int, metavar="OFFSET")
    p.add_argument("--layer", default=None, help="only letters from this layer")
    p.add_argument("--since", default="24h",
                   help="list/--all: letters written since (24h, 90m, 2d, ISO time, epoch ms)")
    p.add_argument("--all", action="store_true", help="redrive every letter listed")
    p.add_argument("--force", action="store_true",
                   help="redrive again, or a value that does not decode here")
    p.add_argument("--show-content", action="store_true", help="show: the decoded event")
    p.add_argument("--json", action="store_true", help="list: as JSON")
    p.set_defaults(func=cmd_dlq)
