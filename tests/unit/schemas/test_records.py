"""The typed mirrors in schemas/records.py are checked against their Avro
schemas, the one place an event type is written by hand: the same fields,
each of the same type, ``NotRequired`` exactly where the schema has a
default. A field added to an ``.avsc`` and not to its TypedDict (or the
other way round, or with another type) fails here, not in a reader at run
time."""

from __future__ import annotations

import json
from pathlib import Path
from types import UnionType
from typing import (
    Any,
    Literal,
    NotRequired,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    is_typeddict,
)

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


# -- types and optionality ----------------------------------------------------

_PRIMITIVES: dict[str, object] = {"string": str, "int": int, "long": int, "float": float,
                                  "double": float, "boolean": bool, "bytes": bytes,
                                  "null": type(None)}


def shape_of_schema(schema: Any, named: dict[str, Any]) -> object:
    """An Avro type as a comparable shape: a Python type, ("record", name),
    ("literal", symbols), ("list", x), ("dict", x) or ("union", {x, ...})."""
    if isinstance(schema, list):
        return ("union", frozenset(shape_of_schema(b, named) for b in schema))
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return _PRIMITIVES[schema]
        return shape_of_schema(named[schema.rpartition(".")[2]], named)
    kind = schema["type"]
    if kind == "record":
        named[schema["name"].rpartition(".")[2]] = schema
        return ("record", schema["name"].rpartition(".")[2])
    if kind == "enum":
        named[schema["name"].rpartition(".")[2]] = schema
        return ("literal", frozenset(schema["symbols"]))
    if kind == "array":
        return ("list", shape_of_schema(schema["items"], named))
    if kind == "map":
        return ("dict", shape_of_schema(schema["values"], named))
    return shape_of_schema(kind, named)


def shape_of_hint(hint: Any) -> object:
    """A typing annotation of schemas/records.py as the same kind of shape."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is NotRequired:
        return shape_of_hint(args[0])
    if origin is Literal:
        return ("literal", frozenset(args))
    if origin in (Union, UnionType):
        return ("union", frozenset(shape_of_hint(a) for a in args))
    if origin is list:
        return ("list", shape_of_hint(args[0]))
    if origin is dict:
        assert args[0] is str, f"a map's keys are strings, not {args[0]}"
        return ("dict", shape_of_hint(args[1]))
    if is_typeddict(hint):
        return ("record", hint.__name__)
    return hint


def fields_of(schema: Any, named: dict[str, Any]) -> dict[str, Any]:
    """Every record of ``schema`` (nested ones too): name -> its Avro fields."""
    found: dict[str, Any] = {}
    pending = [schema]
    while pending:
        current = pending.pop()
        if isinstance(current, list):
            pending += current
        elif isinstance(current, dict):
            if current.get("type") == "record":
                found[current["name"].rpartition(".")[2]] = current["fields"]
                pending += [f["type"] for f in current["fields"]]
            elif current.get("type") in ("array", "map"):
                pending.append(current.get("items", current.get("values")))
    return found


# every named type of every file (a schema names the records other files define)
NAMED: dict[str, Any] = {}
SCHEMAS: dict[str, Any] = {}
for path in sorted(AVRO.glob("*.avsc")):
    loaded = json.loads(path.read_text())
    shape_of_schema(loaded, NAMED)
    for name, fields in fields_of(loaded, NAMED).items():
        SCHEMAS.setdefault(name, fields)
for named_type in list(NAMED.values()):
    fields_of(named_type, NAMED)
    for f in named_type.get("fields", []):
        shape_of_schema(f["type"], NAMED)


def same_type(mirrored: object, declared: object) -> bool:
    """Equal shapes; a Literal of strings may narrow a ``string`` (the values
    Conveyor writes, where the schema leaves room for more)."""
    if mirrored == declared:
        return True
    return (declared is str and isinstance(mirrored, tuple) and mirrored[0] == "literal"
            and all(isinstance(v, str) for v in mirrored[1]))


@pytest.mark.parametrize("name", sorted(n for n in SCHEMAS if hasattr(records, n)))
def test_each_typed_mirror_has_the_types_and_optionality_of_its_schema(name: str) -> None:
    """Each field's type is its schema's; a field a writer may leave out
    (``NotRequired``) has a default in the schema. A field with a default may
    still be required of Conveyor's writers: a decoded event always has it."""
    fields = SCHEMAS[name]
    mirror = getattr(records, name)
    hints = get_type_hints(mirror, include_extras=True)
    wrong = []
    for f in fields:
        hint = hints.get(f["name"])
        if hint is None:
            continue  # the field names are the test above's
        if not same_type(shape_of_hint(hint), shape_of_schema(f["type"], NAMED)):
            wrong.append(f"{f['name']}: {hint} is not {f['type']}")
        if get_origin(hint) is NotRequired and "default" not in f:
            wrong.append(f"{f['name']}: NotRequired, but the schema has no default")
    assert not wrong, f"schemas/records.py {name} and its .avsc differ: {wrong}"
