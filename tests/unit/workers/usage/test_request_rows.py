"""The request index's rows and key layout, without Redis."""

from __future__ import annotations

from dataclasses import fields

import pytest
from pydantic import ValidationError

from conveyor.settings import load_settings
from schemas.records import UsageRecord
from topics.catalog import USAGE
from workers.usage.requests import FILTERS, IndexKeys, RequestRow, index_retention_ms
from workers.usage.rows import DAY_MS


def usage(**over: object) -> dict[str, object]:
    return {"request_id": "r1", "tenant": "acme", "key_id": "k1", "model": "org/m:7b",
            "kind": "chat", "status": "completed", "prompt_tokens": 11,
            "completion_tokens": 5, "entered_ms": 1_000, "finished_ms": 2_000,
            "first_token_ms": 1_200, **over}


def test_a_row_is_its_usage_record_and_reads_back_the_same() -> None:
    row = RequestRow.of(usage())
    assert row == RequestRow("r1", "acme", "k1", "org/m:7b", "chat", "completed", 11, 5,
                             1_000, 2_000, 1_200)
    assert RequestRow.decode(row.encode()) == row
    assert RequestRow.decode(row.encode().encode()) == row  # Redis answers bytes


def test_a_row_has_every_field_of_a_usage_record_in_its_order() -> None:
    assert [f.name for f in fields(RequestRow)] == list(UsageRecord.__annotations__)


def test_a_record_with_no_first_token_or_written_before_the_field_has_none() -> None:
    assert RequestRow.of(usage(first_token_ms=None)).first_token_ms is None
    old = usage()
    del old["first_token_ms"]
    row = RequestRow.of(old)
    assert row.first_token_ms is None and RequestRow.decode(row.encode()) == row


def test_a_failed_request_s_row_keeps_its_error_code_and_an_older_row_reads() -> None:
    row = RequestRow.of(usage(status="error", error_code="server_overloaded"))
    assert row.error_code == "server_overloaded" and RequestRow.decode(row.encode()) == row
    fallback = RequestRow.of(usage(asked_model="phantom"))
    assert fallback.asked_model == "phantom" and RequestRow.decode(fallback.encode()) == fallback
    older = '["r1","acme","k1","m","chat","completed",11,5,1000,2000,1200]'
    assert RequestRow.decode(older).error_code is None
    assert RequestRow.decode(older).asked_model == ""


def test_a_row_written_by_a_newer_version_with_more_fields_reads_without_them() -> None:
    row = RequestRow.of(usage(status="error", error_code="server_overloaded"))
    newer = row.encode()[:-1] + ',"a field of later",7]'
    assert RequestRow.decode(newer) == row
    assert RequestRow.decode(newer.encode()) == row


def test_each_row_is_in_the_set_of_all_and_one_set_per_filter() -> None:
    keys = IndexKeys("cv")
    row = RequestRow.of(usage())
    assert keys.sets_of(row) == ["cv:requests:all", "cv:requests:by-tenant:acme",
                                 "cv:requests:by-key:k1", "cv:requests:by-model:org/m:7b",
                                 "cv:requests:by-status:completed"]
    assert [row.value_of(dim) for dim in FILTERS] == ["acme", "k1", "org/m:7b", "completed"]
    assert keys.row("r1") == "cv:requests:row:r1" and keys.marks() == "cv:requests:indexed"
    with pytest.raises(ValueError, match="no sets by 'kind'"):
        keys.finished("kind", "chat")


def test_the_index_keeps_seven_days_unless_told_within_the_usage_topics() -> None:
    assert index_retention_ms(load_settings()) == 7 * DAY_MS
    assert index_retention_ms(load_settings(request_index_days=0.5)) == DAY_MS // 2
    assert index_retention_ms(load_settings(request_index_days=35)) == USAGE.retention_ms
    with pytest.raises(ValidationError):
        load_settings(request_index_days=36)
