"""``conveyor groups``: every consumer group of this deployment in the order the
pipeline flows, with its state, members and per partition the committed
offset, the end and the lag (:mod:`topics.groups`)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from typing import Any

from cli.text import fail, table
from conveyor.settings import Settings
from topics.clients import KafkaConnectionError, KafkaError
from topics.groups import GroupState, describe_groups

__all__ = ["cmd_groups", "register", "render", "rows"]


def rows(groups: list[GroupState]) -> list[dict[str, Any]]:
    """The groups as JSON-able dicts, each with its total lag."""
    return [{**dataclasses.asdict(g), "lag": g.lag} for g in groups]


def render(groups: list[dict[str, Any]], prefix: str) -> str:
    """Per group a line (layer, group, state, lag), its members and its partitions."""
    if not groups:
        return f"no consumer group of the prefix {prefix}"
    out = []
    for g in groups:
        out.append(f"{g['layer']}  {g['group']}  {g['state']}  lag {g['lag']}")
        out.append("  members: " + (", ".join(g["members"]) or "none"))
        if g["partitions"]:
            lines = [("TOPIC", "PART", "COMMITTED", "END", "LAG", "MEMBER")] + [
                (p["topic"], str(p["partition"]),
                 "-" if p["committed"] is None else str(p["committed"]), str(p["end"]),
                 str(p["lag"]), p["member"] or "-") for p in g["partitions"]]
            out += ["  " + line for line in table(lines, left=1).splitlines()]
    return "\n".join(out)


def cmd_groups(settings: Settings, args: argparse.Namespace) -> int:
    try:
        groups = rows(asyncio.run(describe_groups(settings)))
    except KafkaConnectionError:
        raise  # the command line's own message: Kafka cannot be reached
    except KafkaError as exc:
        return fail(f"conveyor groups: {exc}", 3)
    print(json.dumps(groups, indent=2) if args.json
          else render(groups, settings.kafka.topic_prefix))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "groups", help="consumer groups: state, members and lag per partition",
        description="Every consumer group of this deployment (its topic prefix) in the "
                    "order the pipeline flows: its state, members, and per partition "
                    "the committed offset, the end offset and the lag (records not yet "
                    "consumed; from the partition's start when nothing is committed).")
    p.add_argument("--json", action="store_true", help="the groups as JSON")
    p.set_defaults(func=cmd_groups)
