"""bench.meaning's pieces: the labelled set has its shape (routes with
examples and keywords, prompts for each route and for none, paraphrase and
different-question pairs over the same first prompts), and the registry it
scores with holds the three ways of scoring."""

from __future__ import annotations

import tomllib
from pathlib import Path

from bench.meaning import registry_of

DATA = tomllib.loads((Path(__file__).resolve().parents[2] / "data" / "meaning.toml")
                     .read_text())


def test_the_labelled_set_covers_every_route_the_default_and_both_kinds_of_pair() -> None:
    routes = DATA["routes"]
    assert set(routes) == {"coding", "cooking", "finance"}
    assert all(len(r["examples"]) >= 8 and len(r["keywords"]) >= 10 for r in routes.values())
    labels = {group["route"]: group["texts"] for group in DATA["prompts"]}
    assert set(labels) == {"coding", "cooking", "finance", ""}
    assert sum(len(t) for t in labels.values()) == 60
    held = {group["route"]: group["texts"] for group in DATA["heldout"]}
    assert set(held) == set(labels) and sum(len(t) for t in held.values()) == 32
    assert not {t for texts in held.values() for t in texts} & \
        {t for texts in labels.values() for t in texts}
    examples = {e for r in routes.values() for e in r["examples"]}
    assert not examples & {t for texts in labels.values() for t in texts}  # held out
    paraphrases, different = DATA["cache"]["paraphrases"], DATA["cache"]["different"]
    assert len(paraphrases) == len(different) == 20
    assert [a for a, _ in paraphrases] == [a for a, _ in different]
    assert all(a != b for a, b in paraphrases + different)


def test_the_benchmarks_registry_scores_three_ways() -> None:
    registry = registry_of(DATA)
    both, examples, keywords = (registry.resolve(n) for n in ("both", "examples", "keywords"))
    assert both.encoder == examples.encoder == "minilm" and keywords.encoder == ""
    assert all(r.examples and r.keywords for r in both.routes)
    assert all(r.examples and not r.keywords for r in examples.routes)
    assert all(r.keywords and not r.examples for r in keywords.routes)
    assert {r.model for r in both.routes} == set(DATA["routes"]) and both.default == "default"
