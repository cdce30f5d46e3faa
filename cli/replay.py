"""``conveyor replay REQUEST_ID``: run a recorded request (or a dead letter,
``--from-dlq``) through fresh layers in this process and diff their outputs
with the recorded ones (:mod:`workers.replay`; what is replayed and compared:
docs/operating/log-tools.md). This module parses the command and prints."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from cli.text import add_report_flags, fail, not_found, print_report
from conveyor.settings import Settings
from gateway.dead_letters import read_letters
from topics.lookup import parse_since
from workers.replay import (
    REPLAYABLE,
    Replay,
    ReplayError,
    parse_through,
    replay_letter,
    replay_request,
    report,
)

__all__ = ["cmd_replay", "register", "render"]


def render(rep: dict[str, Any]) -> str:
    """The report for a person: per layer, ``same`` or the differing fields."""
    lines = [f"replay of {rep['request_id']} from {rep['source']} (scratch prefix "
             f"{rep['scratch_prefix']}; not compared: {', '.join(rep['ignored'])})"]
    for x in rep["layers"]:
        lines.append(f"{x['layer']}: {'same' if x['same'] else 'differs'}  "
                     f"(input {', '.join(x['inputs'])}; outputs recorded "
                     f"{x['recorded_outputs']}, replayed {x['replayed_outputs']})")
        err = x["error"]
        if err["recorded"] is not None or err["replayed"] is not None:
            lines.append(f"  error {'same' if err['same'] else 'differs'}: recorded "
                         f"{err['recorded'] or '-'} | replayed {err['replayed'] or '-'}")
        for p in x["outputs"]:
            head = f"  output {p['index']} ({p['recorded_at'] or 'not recorded'})"
            if p.get("missing"):
                lines.append(f"{head}: no {p['missing']} output")
            elif p["same"]:
                lines.append(f"{head}: same")
            else:
                lines.append(f"{head}: {len(p['differ'])} fields differ")
                width = max(len(d["field"]) for d in p["differ"])
                for d in p["differ"]:
                    lines.append(f"    {d['field']:<{width}}  {json.dumps(d['recorded'])}"
                                 f"  ->  {json.dumps(d['replayed'])}")
    return "\n".join(lines)


async def _replay_letter(settings: Settings, request_id: str, offset: int,
                         names: list[str] | None) -> Replay:
    """Read the DLQ's letter at ``offset`` and replay it."""
    letters = await read_letters(settings, 0, [offset])
    if not letters:
        raise ReplayError(f"no letter at offset {offset} of {settings.kafka.topic('dlq')}")
    return await replay_letter(settings, request_id, offset, letters[0].letter, names)


def cmd_replay(settings: Settings, args: argparse.Namespace) -> int:
    try:
        since = parse_since(args.since)
        names = parse_through(args.through) if args.through else None
        if args.from_dlq is None:
            found = asyncio.run(replay_request(settings, args.request_id,
                                               names or ["preprocess"], since))
            if found is None:
                return fail(not_found("replay", settings, args.request_id, args.since), 1)
        else:
            found = asyncio.run(_replay_letter(settings, args.request_id, args.from_dlq, names))
    except (ValueError, ReplayError) as exc:
        return fail(f"conveyor replay: {exc}")
    return print_report(report(found, args.show_content), args.json, render)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "replay", help="run a recorded request through fresh layers and diff their outputs",
        description="Feeds the request's recorded input events (or a dead letter's) to "
                    "fresh instances of the layers, in this process, under a scratch topic "
                    "prefix with the reply address blanked: nothing reaches a live topic or "
                    "a user. Shows each layer's recorded and replayed outputs as a field "
                    "diff. Replayed: " + ", ".join(REPLAYABLE) + ".")
    add_report_flags(p, "print content fields and the events themselves")
    p.add_argument("--through", default=None,
                   help="consecutive layers, e.g. preprocess,route (default: preprocess, or "
                        "with --from-dlq the letter's layer)")
    p.add_argument("--from-dlq", type=int, default=None, metavar="OFFSET",
                   help="replay the event of the letter at this offset of the DLQ")
    p.set_defaults(func=cmd_replay)
