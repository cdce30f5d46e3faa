"""``conveyor replay``'s report: the fields that differ, content hidden unless
asked for, and the report for a person."""

from __future__ import annotations

from cli.replay import Replay, Step, diff, render, report


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
