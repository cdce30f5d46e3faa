"""Routing by meaning: a routed alias read from the registry (and refused
when wrong), keyword scores without a model, embedding scores with the
packaged all-MiniLM-L6-v2, and the route layer's decision in the task: the
chosen model, every route's score, the floor and the method; the same prompt
gets the same decision every time (replay re-runs it)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from conveyor.encoder_files import EncoderFiles, locate_weights
from conveyor.errors import ConveyorError
from conveyor.registry import Registry
from conveyor.settings import load_settings
from gateway.chat.serving import answered_by
from schemas.codec import default_codec
from schemas.records import Prepared
from tests.support.schedule_tasks import full_task
from workers.route import embedder as embedder_module
from workers.route.embedder import Embedders, EncoderUnavailable
from workers.route.layer import RouteLayer
from workers.route.meaning import ABSTAIN, confidences, keyword_score

DATA = tomllib.loads((Path(__file__).resolve().parents[3] / "data" / "meaning.toml")
                     .read_text())
MODELS = '''
[models."coder"]
pool = "cpu"
context_length = 2048
[models."chef"]
pool = "cpu"
context_length = 1024
default_max_tokens = 128
[models."general"]
aliases = ["general-latest"]
pool = "cpu"
context_length = 4096
[models."minilm"]
kind = "embedding"
pool = "embed"
context_length = 256
tokenizer = "hf"
weights = "package:all_minilm_l6_v2"

[models."assistant"]
default = "general-latest"
encoder = "minilm"
[models."assistant".routes.coding]
model = "coder"
examples = EXAMPLES_CODING
keywords = ["python", "javascript"]
[models."assistant".routes.cooking]
model = "chef"
examples = EXAMPLES_COOKING

[models."by-words"]
default = "general"
floor = 0.7
routes.coding = { model = "coder", keywords = ["python", "stack trace", "c++"] }
routes.cooking = { model = "chef", keywords = ["recipe", "oven"] }
'''
CODING = "Write a function in JavaScript that debounces another function."
COOKING = "What is the best way to caramelize onions?"
UNRELATED = "Who won the football World Cup in 2014?"


def registry_text() -> str:
    def toml_list(items: list[str]) -> str:
        return "[" + ", ".join(f'"{i}"' for i in items) + "]"
    return MODELS.replace("EXAMPLES_CODING", toml_list(DATA["routes"]["coding"]["examples"])) \
        .replace("EXAMPLES_COOKING", toml_list(DATA["routes"]["cooking"]["examples"]))


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.parse(registry_text(), "models.toml")


@pytest.fixture(scope="module")
def embedders() -> Embedders:
    return Embedders()  # module-wide: the model is loaded once


def prepared(rid: str, text: str, model: str = "assistant") -> Prepared:
    task = full_task(rid, prompt=text)
    return Prepared(envelope=task["envelope"], generation={**task["generation"], "model": model},
                    prompt=task["prompt"])  # type: ignore[typeddict-item]


async def route_of(layer: RouteLayer, text: str, model: str = "assistant") -> dict[str, Any]:
    [out] = await layer.handle(prepared("r1", text, model), None)
    default_codec().encode("Task", out.record)  # the decision fits the Task's schema
    return dict(out.record["route"])


def test_a_routed_alias_is_read_with_its_routes_default_floor_and_encoder(
        registry: Registry) -> None:
    spec = registry.resolve("assistant")
    assert [r.name for r in spec.routes] == ["coding", "cooking"]
    assert spec.default == "general-latest" and spec.encoder == "minilm"
    assert spec.floor == 0.6  # the default floor
    assert spec.routes[0].keywords == ("python", "javascript")
    # its limits are those every model it may send to keeps
    assert (spec.context_length, spec.default_max_tokens) == (1024, 128)
    words = registry.resolve("by-words")
    assert words.floor == 0.7 and words.routes[1].keywords == ("recipe", "oven")
    # it serves no pool of its own
    assert registry.pools() == ("cpu", "embed")


@pytest.mark.parametrize("entry, fault", [
    ('default = "general"\nroutes.a = { model = "nope", keywords = ["x"] }',
     "route model `nope` is not"),
    ('routes.a = { model = "coder", keywords = ["x"] }', "has no `default`"),
    ('default = "general"\nroutes.a = { model = "coder" }', "needs examples or keywords"),
    ('default = "general"\nroutes.a = { model = "coder", examples = ["x"] }',
     "examples are scored by an encoder"),
    ('default = "general"\nencoder = "coder"\nroutes.a = { model = "coder", examples = ["x"] }',
     "its encoder `coder` is not an embedding model"),
    ('default = "general"\nfloor = 1.5\nroutes.a = { model = "coder", keywords = ["x"] }',
     "floor must be a confidence from 0 to 1"),
    ('default = "general"\nroutes.a = { model = "coder", keywords = [""] }',
     "must be lists of non-empty text"),
    ('default = "general"\nroutes.a = { model = "coder", words = ["x"] }',
     "unknown field `words`"),
    ('default = "minilm"\nroutes.a = { model = "coder", keywords = ["x"] }',
     "route model `minilm` is not a generation model"),
    ('default = "general"\nroutes.a = { model = "coder", keywords = ["x"] }\n'
     '[models."other"]\npool = "cpu"\ncontext_length = 64\nfallbacks = ["bad"]',
     "its fallback `bad` routes by meaning"),
    ('default = "general"\nroutes.a = { model = "bad", keywords = ["x"] }',
     "route model `bad` is not"),
])
def test_a_wrong_routed_alias_is_refused_with_what_is_wrong(entry: str, fault: str) -> None:
    text = MODELS.split('[models."assistant"]')[0] + f'[models."bad"]\n{entry}\n'
    with pytest.raises(ConveyorError, match="models.toml") as caught:
        Registry.parse(text, "models.toml")
    assert fault in str(caught.value)


def test_keywords_score_whole_words_and_phrases_without_a_model() -> None:
    assert keyword_score("How do I fix this Python stack  trace?",
                         ("python", "stack trace", "c++")) == pytest.approx(2 / 2.5)
    assert keyword_score("My C++ build fails", ("c++",)) == pytest.approx(1 / 1.5)
    assert keyword_score("A pythonic idea", ("python",)) == 0.0  # not a word of its own
    assert keyword_score("", ("python",)) == 0.0


def test_confidences_abstain_for_a_prompt_like_no_route() -> None:
    far = confidences([0.1, 0.05])
    assert max(far) < 0.2  # the abstention takes the rest
    near = confidences([0.45, 0.1])
    assert near[0] > 0.99
    assert confidences([ABSTAIN + 0.05, None])[1] == 0.0  # a route without examples


async def test_the_alias_routes_coding_and_cooking_to_their_models_and_the_rest_to_default(
        registry: Registry, embedders: Embedders) -> None:
    layer = RouteLayer(load_settings(topic_prefix="r"), registry, embedders=embedders)
    coding = await route_of(layer, CODING)
    assert coding["model"] == "coder" and coding["pool"] == "cpu"
    meaning = coding["meaning"]
    assert meaning["alias"] == "assistant" and meaning["method"] == "embedding"
    assert meaning["route"] == "coding" and meaning["model"] == "coder"
    assert meaning["floor"] == 0.6
    scores = {s["route"]: s["score"] for s in meaning["scores"]}
    assert scores["coding"] >= 0.6 > scores["cooking"]
    assert [s["model"] for s in meaning["scores"]] == ["coder", "chef"]

    cooking = await route_of(layer, COOKING)
    assert cooking["model"] == "chef" and cooking["meaning"]["route"] == "cooking"

    unrelated = await route_of(layer, UNRELATED)
    assert unrelated["model"] == "general"  # the default, by its canonical name
    assert unrelated["meaning"]["route"] == "" and unrelated["meaning"]["model"] == "general-latest"
    assert all(s["score"] < 0.6 for s in unrelated["meaning"]["scores"])

    # a model that does not route by meaning carries no decision
    assert (await route_of(layer, CODING, model="coder"))["meaning"] is None


async def test_the_same_prompt_gets_the_same_decision_from_a_fresh_registry_and_model(
        registry: Registry, embedders: Embedders) -> None:
    settings = load_settings(topic_prefix="r")
    first = await route_of(RouteLayer(settings, registry, embedders=embedders), COOKING)
    again = await route_of(RouteLayer(settings, Registry.parse(registry_text(), "m"),
                                      embedders=Embedders()), COOKING)
    assert again["meaning"] == first["meaning"]


async def test_keywords_route_without_an_encoder_and_below_the_floor_go_to_default(
        registry: Registry) -> None:
    layer = RouteLayer(load_settings(topic_prefix="r"), registry, embedders=Embedders())
    two = await route_of(layer, "My Python stack trace points at line 3", "by-words")
    assert two["model"] == "coder" and two["meaning"]["method"] == "keywords"
    assert two["meaning"]["scores"][0]["score"] == 0.8
    one = await route_of(layer, "A recipe for bread, please", "by-words")  # 0.67 < 0.7
    assert one["model"] == "general" and one["meaning"]["route"] == ""
    empty = await route_of(layer, "   ", "by-words")
    assert empty["meaning"]["scores"] == [{"route": "coding", "model": "coder", "score": 0.0},
                                          {"route": "cooking", "model": "chef", "score": 0.0}]
    assert layer.embedders._made == {}  # keywords alone never load a model


def test_the_gateway_names_the_routed_model(registry: Registry) -> None:
    assert answered_by(registry, "assistant", "coder") == {"x-conveyor-route": "coder"}
    assert answered_by(registry, "assistant", "general") == {"x-conveyor-route": "general"}
    assert answered_by(registry, "assistant", "other") == {"x-conveyor-fallback": "other"}


async def test_an_encoder_that_cannot_load_leaves_keywords_and_no_cache(tmp_path: Path) -> None:
    from conveyor.policy.rules import DEFAULT_SCOPE, PolicyBook

    text = registry_text().replace('weights = "package:all_minilm_l6_v2"',
                                   f'weights = "{tmp_path / "missing.zip"}"')
    registry = Registry.parse(text, "models.toml")
    book = PolicyBook()
    book.set(DEFAULT_SCOPE, "[cache]\nsemantic = true\n")
    layer = RouteLayer(load_settings(topic_prefix="r", redis_url="redis://127.0.0.1:1/0"),
                       registry, policies=book, embedders=Embedders())
    try:
        route = await route_of(layer, "Fix this Python error in my JavaScript build")
        # the coding route's two keywords still route it; nothing was looked up
        assert route["model"] == "coder" and route["meaning"]["method"] == "keywords"
        assert route["meaning"]["scores"][0]["score"] == 0.8
        [out] = await layer.handle(prepared("r2", CODING), None)
        assert out.event_type == "Task" and not out.record["prompt"].get("cache_key")
    finally:
        await layer.stop()


def test_an_encoder_whose_weights_are_no_model_is_unavailable_and_not_read_again(
        tmp_path: Path) -> None:
    """Whatever its files raise while loading (here a weights file too short to
    hold its header: struct's error), the encoder is unavailable (the callers
    go on without meaning) and not loaded again until the retry time."""
    model = tmp_path / "model"
    model.mkdir()
    packaged = EncoderFiles(locate_weights("package:all_minilm_l6_v2"))
    (model / "config.json").write_bytes(packaged.read("config.json"))
    (model / "model.safetensors").write_bytes(b"abc")
    text = registry_text().replace('weights = "package:all_minilm_l6_v2"', f'weights = "{model}"')
    embedder = Embedders().get(Registry.parse(text, "models.toml").resolve("minilm"))
    with pytest.raises(EncoderUnavailable, match="cannot be loaded.*error"):
        embedder.vector("Fix my Python bug")
    (model / "config.json").unlink()  # a second load would fail otherwise: it is not tried
    with pytest.raises(EncoderUnavailable, match="cannot be loaded.*error"):
        embedder.vector("Fix my Python bug")


def test_a_run_of_prompts_never_pushes_a_route_s_examples_out(
        registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedder_module, "_KEPT", 2)
    embedder = Embedders().get(registry.resolve("minilm"))
    embedder.vector("Write a Python function.", example=True)
    model, _ = embedder._load()  # noqa: SLF001
    passes: list[int] = []
    real = model.embed
    monkeypatch.setattr(model, "embed", lambda ids: passes.append(len(ids)) or real(ids))
    for n in range(4):  # more prompts than are kept
        embedder.vector(f"A question number {n}?")
    assert len(passes) == 4
    embedder.vector("Write a Python function.", example=True)
    assert len(passes) == 4  # the example was still kept: no forward pass
