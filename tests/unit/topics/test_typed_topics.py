"""The topics are declared once (topics/catalog.py): each names the event types
it carries, and the catalog, the dead-letter tools and every reader go by it."""

from __future__ import annotations

from typing import Any, cast

import pytest

from conveyor.errors import SchemaError
from conveyor.settings import load_settings
from gateway.dead_letters import event_type_of
from schemas.codec import EVENT_TYPES, default_codec
from schemas.records import Control
from topics.catalog import CONTROL, INFER, KEYS, REQUESTS, TOKENS, TOPICS, catalog, topic_named


def test_names_are_unique_and_events_are_known() -> None:
    assert len({t.name for t in TOPICS}) == len(TOPICS)
    assert all(e in EVENT_TYPES for t in TOPICS for e in t.events)
    # and every event type the codec knows travels on a topic, alone or in a batch
    # record (the chunks of conveyor.tokens): none is declared for nothing
    assert set(EVENT_TYPES) == {e for t in (*TOPICS, INFER)
                                for e in (*t.events, *(x.__name__ for x in t.types))}


def test_the_catalog_is_the_table_plus_the_pools() -> None:
    s = load_settings(topic_prefix="tt", pipeline_partitions=3, reply_partitions=5)
    specs = {spec.name: spec for spec in catalog(s.kafka, ("cpu",))}
    assert set(specs) == {t.at(s.kafka) for t in TOPICS} | {"tt.infer.cpu"}
    assert specs[TOKENS.at(s.kafka)].partitions == 3 and specs["tt.replies"].partitions == 5
    assert specs[KEYS.at(s.kafka)].configs()["cleanup.policy"] == "compact"


def test_a_topic_is_found_by_its_full_name_and_gives_its_event_type() -> None:
    s = load_settings(topic_prefix="tt")
    assert topic_named(s.kafka, "tt.requests") is REQUESTS
    assert topic_named(s.kafka, "other.requests") is None
    assert event_type_of(s, "tt.tokens") == "TokenBatch"
    assert event_type_of(s, "tt.infer.gpu") == "Task"
    assert event_type_of(s, "tt.keys") is None  # two event types: the letter's must say


def test_a_topic_decodes_its_own_events_and_refuses_others() -> None:
    codec = default_codec()
    control: Control = {"request_id": "r1", "action": "cancel", "reason": "", "ts_ms": 1}
    value = CONTROL.encode(codec, control)
    assert CONTROL.decode(codec, value) == control
    with pytest.raises(SchemaError, match="expected a TokenBatch"):
        TOKENS.unpack(codec, value)
    assert KEYS.events == ("ApiKey", "TenantPolicy")
    with pytest.raises(ValueError, match="name the event type"):
        KEYS.encode(codec, cast(Any, {}))


def test_a_topic_of_batches_unpacks_its_records_into_their_events() -> None:
    from tests.support.factories import chunk

    codec = default_codec()
    chunks = [chunk("r1", 0, "a"), chunk("r2", 0, "b"), chunk("r1", 1, "c")]
    value = TOKENS.encode(codec, TOKENS.pack(chunks))
    assert TOKENS.events == ("TokenBatch",)
    assert TOKENS.unpack(codec, value) == chunks
    with pytest.raises(TypeError, match="unpack"):
        TOKENS.decode(codec, value)
    assert CONTROL.unpack(codec, CONTROL.encode(codec, cast(Control, {
        "request_id": "r", "action": "cancel", "reason": "", "ts_ms": 1}))) == [
        {"request_id": "r", "action": "cancel", "reason": "", "ts_ms": 1}]
