"""A schema never changes without its previous version kept readable.

``schemas/avro/current.fingerprints`` lists the fingerprint of every event
type's current schema. Changing a schema changes its fingerprint, and this
test fails until the change is finished: the previous version copied
(self-contained) into ``avro/history/`` so that events already in the log
are still read, and the list updated."""

from __future__ import annotations

from pathlib import Path

from fastavro.schema import fingerprint, to_parsing_canonical_form

from schemas.codec import EVENT_TYPES, Codec

LISTED = Path(__file__).resolve().parents[3] / "schemas" / "avro" / "current.fingerprints"


def listed() -> dict[str, str]:
    rows = [line.split() for line in LISTED.read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return {name: fp for name, fp in rows}


def test_every_current_schema_is_the_listed_one() -> None:
    codec = Codec()
    current = {name: fingerprint(to_parsing_canonical_form(codec.schema(name)), "CRC-64-AVRO")
               for name in EVENT_TYPES}
    changed = sorted(n for n in EVENT_TYPES if listed().get(n) != current[n])
    assert not changed, (
        f"schemas changed: {changed}. Copy each one's previous version (self-contained) "
        "into schemas/avro/history/ as conveyor.<Type>.v<N>.avsc, then update "
        "schemas/avro/current.fingerprints")
