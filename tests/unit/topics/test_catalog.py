"""The topic catalog matches docs/architecture.md: every topic, under the prefix, sized by the
settings. What the broker makes of each topic's configs (compaction, retention,
replication) is tested against the broker in tests/kafka/topics/test_admin.py."""

from __future__ import annotations

import pytest

from conveyor.settings import Settings, load_settings
from topics.catalog import TopicSpec, catalog, infer_topic

DESIGN_TOPICS = ["requests", "prepared", "routed", "tokens", "replies", "control", "workers",
                 "results", "dlq", "feedback", "usage", "audit", "keys", "jobs", "job-status",
                 "breakers", "models", "policies"]


@pytest.fixture
def settings() -> Settings:
    return load_settings(topic_prefix="tcat")


def by_name(specs: list[TopicSpec]) -> dict[str, TopicSpec]:
    return {s.name: s for s in specs}


def test_every_design_topic_is_present_with_the_prefix(settings: Settings) -> None:
    names = by_name(catalog(settings.kafka))
    for topic in DESIGN_TOPICS:
        assert f"tcat.{topic}" in names
    assert all(name.startswith("tcat.") for name in names)
    assert len(names) == len(catalog(settings.kafka))  # no duplicates


def test_partition_counts_follow_the_settings() -> None:
    s = load_settings(topic_prefix="tcat", pipeline_partitions=3, reply_partitions=5,
                 infer_partitions=6)
    specs = by_name(catalog(s.kafka, ("cpu",)))
    assert specs["tcat.requests"].partitions == 3
    assert specs["tcat.tokens"].partitions == 3
    assert specs["tcat.replies"].partitions == 5
    assert specs["tcat.infer.cpu"].partitions == 6
    assert specs["tcat.control"].partitions == 1


def test_an_infer_topic_per_pool(settings: Settings) -> None:
    assert infer_topic(settings.kafka, "gpu") == "tcat.infer.gpu"
    without = by_name(catalog(settings.kafka))
    assert not [n for n in without if ".infer." in n]
    specs = by_name(catalog(settings.kafka, ("cpu", "gpu")))
    assert "tcat.infer.cpu" in specs and "tcat.infer.gpu" in specs
    assert len(specs) == len(DESIGN_TOPICS) + 2
