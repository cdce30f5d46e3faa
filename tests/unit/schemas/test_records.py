"""The typed mirrors in schemas/records.py have exactly the fields of their
Avro schemas: a field added to an ``.avsc`` and not to its TypedDict (or the
other way round) fails here, not in a reader at run time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from schemas import records
from schemas.codec import EVENT_TYPES

AVRO = Path(records.__file__).with_name("avro")


def named_records(schema: Any, found: dict[str, list[str]]) -> dict[str, list[str]]:
    """Every record defined in ``schema`` (nested ones too): name -> its field names."""
    if isinstance(schema, list):
        for branch in schema:
            named_records(branch, found)
    elif isinstance(schema, dict):
        if schema.get("type") == "record":
            found[schema["name"].rpartition(".")[2]] = [f["name"] for f in schema["fields"]]
            for f in schema["fields"]:
                named_records(f["type"], found)
        elif schema.get("type") in ("array", "map"):
            named_records(schema.get("items", schema.get("values")), found)
    return found


RECORDS: dict[str, list[str]] = {}
for path in sorted(AVRO.glob("*.avsc")):
    named_records(json.loads(path.read_text()), RECORDS)


@pytest.mark.parametrize("name", sorted(n for n in RECORDS if hasattr(records, n)))
def test_each_typed_mirror_has_the_fields_of_its_schema(name: str) -> None:
    mirrored = set(getattr(records, name).__annotations__)
    assert mirrored == set(RECORDS[name]), (
        f"schemas/records.py {name} and its .avsc differ: only in the mirror "
        f"{sorted(mirrored - set(RECORDS[name]))}, only in the schema "
        f"{sorted(set(RECORDS[name]) - mirrored)}")


def test_every_event_type_has_its_schema_and_its_mirror() -> None:
    assert [e for e in EVENT_TYPES if e not in RECORDS or not hasattr(records, e)] == []
