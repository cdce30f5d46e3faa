"""A replay's report (the fields that differ, content hidden unless asked for,
and the report for a person ``conveyor replay`` prints), which layers it runs,
and its scratch settings."""

from __future__ import annotations

import pytest

from cli.replay import render
from conveyor.settings import load_settings
from workers.replay import (
    Replay,
    ReplayError,
    Step,
    chains,
    diff,
    parse_through,
    report,
    scratch_settings,
)


def test_diff_names_differing_fields_only_and_hides_content() -> None:
    a = {"envelope": {"stamps": {"route": 1}, "attempt": 0, "tenant": "t"},
         "prompt": {"text": "secret words", "tokens": 5}}
    b = {"envelope": {"stamps": {"route": 2}, "attempt": 1, "tenant": "t"},
         "prompt": {"text": "other words!", "tokens": 6}}
    assert diff(a, b) == [
        {"field": "prompt.text", "recorded": "<12 chars>", "replayed": "<12 chars>"},
        {"field": "prompt.tokens", "recorded": 5, "replayed": 6}]
    assert diff(a, b, show_content=True)[0]["replayed"] == "other words!"
    assert diff(a, a) == []


def test_render_shows_only_the_fields_that_differ() -> None:
    env = {"request_id": "r1", "stamps": {"route": 1}, "reply_partition": 3}
    step = Step("route", ["replayed preprocess"],
                           recorded=[{"envelope": env, "route": {"pool": "cpu", "model": "a"}}],
                           recorded_at=["t.routed[0]@7"],
                           replayed=[{"envelope": {**env, "stamps": {"route": 2},
                                                   "reply_partition": -1},
                                      "route": {"pool": "gpu", "model": "a"}}])
    rep = report(Replay("r1", "replay1", "log", [step]))
    assert not rep["same"] and rep["layers"][0]["outputs"][0]["differ"] == [
        {"field": "route.pool", "recorded": "cpu", "replayed": "gpu"}]
    text = render(rep)
    assert "route: differs" in text and "1 fields differ" in text
    assert 'route.pool  "cpu"  ->  "gpu"' in text and "stamps" not in text.split(")", 1)[1]


def test_through_names_consecutive_replayable_layers() -> None:
    assert parse_through("preprocess, route") == ["preprocess", "route"]
    assert parse_through("postprocess") == ["postprocess"]
    with pytest.raises(ValueError, match="worker partition"):
        parse_through("route,schedule")
    with pytest.raises(ValueError, match="follow one another"):
        parse_through("route,preprocess")
    with pytest.raises(ValueError, match="follow one another"):
        parse_through("preprocess,postprocess")
    with pytest.raises(ValueError, match="unknown layer"):
        parse_through("gateway")


def test_the_replayed_layers_run_in_chains_of_consecutive_ones() -> None:
    assert chains(["preprocess", "route", "postprocess"]) == [["preprocess", "route"],
                                                              ["postprocess"]]
    assert chains(["route"]) == [["route"]]
    assert chains(["preprocess", "postprocess"]) == [["preprocess"], ["postprocess"]]
    with pytest.raises(ReplayError, match="not in the flow's order"):
        chains(["route", "preprocess"])
    with pytest.raises(ReplayError, match="not in the flow's order"):
        chains(["route", "route"])
    with pytest.raises(ReplayError, match="needs an engine"):
        chains(["preprocess", "infer"])
    with pytest.raises(ReplayError, match="no layer"):
        chains([])


def test_scratch_settings_keep_everything_but_the_prefix() -> None:
    s = load_settings(topic_prefix="live")
    scratch = scratch_settings(s, now_ms=1234)
    assert scratch.kafka.topic("prepared") == "replay1234.prepared"
    assert scratch.kafka.bootstrap == s.kafka.bootstrap and s.kafka.topic_prefix == "live"
