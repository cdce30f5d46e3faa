"""Avro single-object encoding for Conveyor's events.

Every value on a Conveyor topic is ``C3 01`` + the 8-byte little-endian
CRC-64-AVRO fingerprint of the writer's schema (its parsing canonical form)
+ the Avro binary body. The encoding describes itself: a reader looks the
fingerprint up among every schema version it knows (the current ones in
``avro/`` and the earlier ones kept in ``avro/history/``) and resolves the
writer's schema to its own, so an event written by an older producer is
still read. A value whose fingerprint is unknown, or that does not parse,
raises :class:`conveyor.errors.SchemaError` (a poison event).
"""

from __future__ import annotations

import base64
import io
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, get_args

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import fingerprint, load_schema, to_parsing_canonical_form

from conveyor.errors import SchemaError

__all__ = ["Codec", "EventType", "EVENT_TYPES", "default_codec", "learn_writers", "plain",
           "MAGIC"]

MAGIC = b"\xc3\x01"
_HEADER = len(MAGIC) + 8

EventType = Literal[
    "Request",
    "Prepared",
    "Task",
    "TokenChunk",
    "TokenBatch",
    "Reply",
    "ReplyBatch",
    "Control",
    "WorkerHeartbeat",
    "DeadLetter",
    "UsageRecord",
    "AuditEvent",
    "ApiKey",
    "TenantPolicy",
    "JobCommand",
    "JobStatus",
    "JobResult",
    "BreakerState",
    "ModelRegistry",
    "Feedback",
    "PolicyDocument",
]
EVENT_TYPES: tuple[EventType, ...] = get_args(EventType)

_AVRO_DIR = Path(__file__).with_name("avro")


def _fingerprint(schema: Any) -> bytes:
    hexdigest = fingerprint(to_parsing_canonical_form(schema), "CRC-64-AVRO")
    return bytes.fromhex(hexdigest)


class Codec:
    """Encodes with the current schema of each event type; decodes any known version."""

    def __init__(self, avro_dir: Path = _AVRO_DIR) -> None:
        self._current: dict[str, tuple[bytes, Any]] = {}
        # fingerprint -> (event type, writer schema)
        self._known: dict[bytes, tuple[str, Any]] = {}
        for name in EVENT_TYPES:
            schema = load_schema(str(avro_dir / f"conveyor.{name}.avsc"))
            fp = _fingerprint(schema)
            self._current[name] = (MAGIC + fp, schema)
            self._known[fp] = (name, schema)
        history = avro_dir / "history"
        for path in sorted(history.glob("*.avsc")) if history.is_dir() else []:
            self.register_writer(path)

    def register_writer(self, path: Path) -> str:
        """Make an older version of a schema readable. Its file is named
        ``conveyor.<Type>.v<N>.avsc`` and must be self-contained."""
        name = path.name.split(".")[1]
        if name not in self._current:
            raise SchemaError(f"{path.name}: unknown event type {name!r}")
        schema = parse_schema(json.loads(path.read_text()), _write_hint=False)
        self._known[_fingerprint(schema)] = (name, schema)
        return name

    def schema(self, event_type: EventType) -> Any:
        return self._current[event_type][1]

    def encode(self, event_type: EventType, record: Any) -> bytes:
        header, schema = self._current[event_type]
        buf = io.BytesIO()
        buf.write(header)
        try:
            schemaless_writer(buf, schema, record)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SchemaError(f"cannot encode {event_type}: {exc}") from exc
        return buf.getvalue()

    def decode(self, data: bytes | None, expected: EventType | tuple[EventType, ...]) -> Any:
        """Decode a value into the current shape of ``expected`` (one of them:
        the value's own type). Typed: :meth:`topics.catalog.Topic.decode`."""
        if not data or len(data) < _HEADER or data[:2] != MAGIC:
            raise SchemaError("not an Avro single-object encoded value")
        known = self._known.get(data[2:_HEADER])
        if known is None:
            raise SchemaError(f"unknown schema fingerprint {data[2:_HEADER].hex()}")
        name, writer = known
        if name != expected and (isinstance(expected, str) or name not in expected):
            raise SchemaError(f"expected a {' or '.join(_names(expected))} event, got a {name}")
        reader = self._current[name][1]
        try:
            return schemaless_reader(
                io.BytesIO(data[_HEADER:]),
                writer,
                None if writer is reader else reader,
            )
        except Exception as exc:  # fastavro raises many kinds on corrupt bytes
            raise SchemaError(f"cannot decode {name}: {exc}") from exc


def _names(expected: EventType | tuple[EventType, ...]) -> tuple[str, ...]:
    return (expected,) if isinstance(expected, str) else expected


@lru_cache(maxsize=1)
def default_codec() -> Codec:
    """The codec over the schemas shipped with Conveyor (parsed once), and any
    version a process learned at start (:func:`learn_writers`)."""
    return Codec()


def learn_writers(folder: Path) -> list[str]:
    """Make every schema version in ``folder`` (``conveyor.<Type>.v<N>.avsc``)
    readable by this process's codec; the event types learned. SchemaError for
    a folder that is not one, or a file that is not such a schema."""
    if not folder.is_dir():
        raise SchemaError(f"the schema history {folder} is not a folder")
    learned = []
    for path in sorted(folder.glob("*.avsc")):
        try:
            learned.append(default_codec().register_writer(path))
        except SchemaError:
            raise
        except Exception as exc:  # unreadable, not JSON, not an Avro schema, a bad name
            raise SchemaError(f"{path}: not a schema version Conveyor can read ({exc})"
                              ) from exc
    return learned


def plain(value: Any) -> Any:
    """A decoded record made JSON-able (bytes as base64)."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
