"""What the log tools (inspect, replay, dlq) share: a decoded record as JSON
(an error, often a traceback, is its last line: ``conveyor.errors.last_line``),
a report printed as JSON or as text, and the flags that choose which."""

from __future__ import annotations

import argparse
import base64
import json
from collections.abc import Callable
from typing import Any

from conveyor.settings import Settings
from topics.catalog import REQUESTS

__all__ = ["plain", "add_report_flags", "print_report", "not_found"]

SINCE_HELP = ("how long ago the request may have entered: 24h, 90m, 2d, an ISO time or "
              "epoch ms (default 24h)")


def plain(value: Any) -> Any:
    """A decoded record made JSON-able (bytes as base64)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


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
