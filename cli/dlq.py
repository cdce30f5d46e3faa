"""``conveyor dlq``: list dead letters with their errors, show one, and redrive
them to where they came from (:mod:`gateway.dead_letters`). A letter is named
by its offset in ``conveyor.dlq``; usage and what a redrive refuses without
``--force``: docs/operating/log-tools.md."""

from __future__ import annotations

import argparse
import asyncio
import json

from cli.text import fail
from conveyor.errors import last_line
from conveyor.settings import Settings
from gateway.audit import cli_actor
from gateway.dead_letters import Letter, check, event_type_of, read_letters, redrive, redriven
from schemas.codec import default_codec, plain
from topics.envelope import iso
from topics.lookup import parse_since

__all__ = ["register"]

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
    problem = check(settings, codec, d)
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
    results = asyncio.run(redrive(settings, letters, cli_actor(), force=args.force))
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
