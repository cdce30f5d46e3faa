"""What ``conveyor models apply`` publishes (topics/models.py): the file's text,
its digest, where it came from and who applied it, once it parses whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.errors import ConveyorError
from topics.models import record_of

FILE = Path(__file__).resolve().parents[2] / "data" / "models.toml"
LIVE = FILE.read_text().replace('aliases = ["smollm2"]', 'aliases = ["smollm2", "smollm2-live"]')


def test_a_record_carries_the_text_its_digest_and_its_origin() -> None:
    record = record_of(LIVE, "live.toml")
    assert record["text"] == LIVE and len(record["digest"]) == 12
    assert record["source"] == "live.toml" and "@" in record["applied_by"]
    assert record_of(LIVE, "again.toml")["digest"] == record["digest"]


def test_a_bad_file_is_refused_whole_with_the_model_and_field_named() -> None:
    bad = LIVE + '\n[models."half"]\ncontext_length = 100\n'
    with pytest.raises(ConveyorError, match="bad.toml: model `half` has no `pool`"):
        record_of(bad, "bad.toml")
    with pytest.raises(ConveyorError, match="its fallback `nowhere` is not a model"):
        record_of(LIVE.replace('fallbacks = ["smollm2-135m-instruct"]',
                               'fallbacks = ["nowhere"]'), "bad.toml")
