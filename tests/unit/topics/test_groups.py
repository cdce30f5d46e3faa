"""What a consumer group is, the order the groups are listed in, and lag."""

from __future__ import annotations

from conveyor.settings import load_settings
from topics.groups import FLOW, GroupState, PartitionLag, in_flow_order, lag_of, layer_of
from workers.jobs.dead_commands import DEAD_COMMANDS_GROUP
from workers.stages import stage_names


def test_a_group_is_named_by_its_layer_under_the_prefix() -> None:
    s = load_settings(topic_prefix="live")
    assert layer_of(s, "live.preprocess") == "preprocess"
    assert layer_of(s, "live.infer.cpu") == "infer:cpu"
    assert layer_of(s, "live.infer.gpu.big") == "infer:gpu.big"
    assert layer_of(s, "live.jobs-dead-letters") == "jobs-dead-letters"
    assert layer_of(s, "live.something-else") == "something-else"
    assert layer_of(s, "lively.preprocess") is None
    assert layer_of(s, "other.preprocess") is None
    assert layer_of(s, "live.") is None
    assert layer_of(s, "live") is None


def test_the_groups_run_as_the_pipeline_flows() -> None:
    layers = ["results", "zzz", "postprocess", "infer:gpu", "accounting", "route",
              "jobs-dead-letters", "infer:cpu", "schedule", "jobs", "preprocess", "aaa"]
    assert in_flow_order(layers) == [
        "preprocess", "route", "schedule", "infer:cpu", "infer:gpu", "postprocess",
        "accounting", "jobs", "results", "jobs-dead-letters", "aaa", "zzz"]


def test_the_flow_names_every_group_conveyor_makes() -> None:
    # the layers' groups (workers/stages.py), the infer pools', the accounting
    # app's and the jobs layer's dead commands'
    assert set(stage_names()) | {"infer", "accounting", DEAD_COMMANDS_GROUP} == set(FLOW)


def test_lag_runs_from_the_commit_or_the_start_to_the_end() -> None:
    assert lag_of(committed=7, start=0, end=10) == 3
    assert lag_of(committed=10, start=0, end=10) == 0
    assert lag_of(committed=None, start=4, end=10) == 6  # nothing committed: from the start
    assert lag_of(committed=None, start=10, end=10) == 0
    assert lag_of(committed=12, start=0, end=10) == 0  # never below 0


def test_a_groups_lag_is_the_sum_of_its_partitions() -> None:
    parts = [PartitionLag("t.requests", 0, 5, 9, 4, "c@h"),
             PartitionLag("t.requests", 1, None, 3, 3, None)]
    assert GroupState("t.preprocess", "preprocess", "Stable", ["c@h"], parts).lag == 7
    assert GroupState("t.route", "route", "Empty", [], []).lag == 0
