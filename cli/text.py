"""What the log tools (inspect, replay, dlq) print the same way: a decoded
record as JSON (an error, often a traceback, is its last line:
``conveyor.errors.last_line``)."""

from __future__ import annotations

import base64
from typing import Any

__all__ = ["plain"]


def plain(value: Any) -> Any:
    """A decoded record made JSON-able (bytes as base64)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
