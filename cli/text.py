"""What the log tools (inspect, replay, dlq) share: a decoded record as JSON
(an error, often a traceback, is its last line: ``conveyor.errors.last_line``),
a report printed as JSON or as text, and the flags that choose which."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from conveyor.settings import Settings
from topics.catalog import REQUESTS

__all__ = ["READ_WITHIN_S", "add_report_flags", "fail", "not_found",
           "print_report", "table", "unread", "utc"]

READ_WITHIN_S = 30.0  # how long a command waits to read a compacted topic's state

SINCE_HELP = ("how long ago the request may have entered: 24h, 90m, 2d, an ISO time or "
              "epoch ms (default 24h)")


def add_report_flags(p: argparse.ArgumentParser, show_content: str) -> None:
    """A request's report: ``request_id``, ``--since``, ``--json``, ``--show-content``."""
    p.add_argument("request_id")
    p.add_argument("--since", default="24h", help=SINCE_HELP)
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--show-content", action="store_true", help=show_content)


def print_report(rep: dict[str, Any], as_json: bool,
                 render: Callable[[dict[str, Any]], str]) -> int:
    print(json.dumps(rep, indent=2, ensure_ascii=False) if as_json else render(rep))
    return 0


def not_found(command: str, settings: Settings, request_id: str, since: str) -> str:
    return (f"conveyor {command}: no request {request_id} in {REQUESTS.at(settings.kafka)} "
            f"since {since} (widen --since)")


def utc(ms: int, fmt: str = "%Y-%m-%dT%H:%M:%SZ") -> str:
    """Epoch milliseconds as a UTC time in ``fmt`` (``2026-11-01T12:30:00Z``)."""
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime(fmt)


def table(lines: Sequence[Sequence[str]], left: int | None = None) -> str:
    """Rows as columns two spaces apart: the first ``left`` columns (all when None)
    aligned left, the others right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) if left is None or i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths, strict=True)))
                     .rstrip() for line in lines)


def fail(message: str, status: int = 2) -> int:
    """Say ``message`` on stderr; the exit status ``status``."""
    print(message, file=sys.stderr)
    return status


def unread(command: str, what: str) -> int:
    """Say that ``what`` was not read within :data:`READ_WITHIN_S`; exit status 3."""
    return fail(f"conveyor {command}: {what} not read within {READ_WITHIN_S:.0f} s", 3)
