"""Preprocess on an embedding request: normalised inputs, counts with the
model's own tokenizer, and a 400 naming ``input`` or ``model`` for what the
model cannot take."""

from __future__ import annotations

import pytest

from conveyor.errors import InvalidRequest
from conveyor.registry import ModelSpec
from schemas.openai.embeddings import EmbeddingBody, embedding_generation
from schemas.records import Generation
from tests.support.factories import request as make_request
from workers.preprocess.embedding import check_kind, measure_inputs, normalize_embedding
from workers.preprocess.tokenizers import HfTokenizer

SPEC = ModelSpec(name="all-minilm-l6-v2", pool="embed", context_length=16, kind="embedding",
                 tokenizer="hf", weights="package:all_minilm_l6_v2")


def generation(given: object) -> Generation:
    return embedding_generation(EmbeddingBody.model_validate({"model": "m", "input": given}))


def test_inputs_are_normalised_and_counted_with_their_special_tokens() -> None:
    texts = normalize_embedding(generation(["cafe\u0301\x00", "hello world"]))["embedding"]
    ids = normalize_embedding(generation([7592, 2088]))["embedding"]
    assert texts is not None and ids is not None
    assert texts["inputs"] == ["caf\u00e9", "hello world"] and ids["inputs"] == [[7592, 2088]]
    tokenizer = HfTokenizer("package:all_minilm_l6_v2")
    assert tokenizer.count("hello world") == 2
    assert measure_inputs(texts, tokenizer, SPEC) == (1 + 2) + (2 + 2)
    assert measure_inputs(ids, tokenizer, SPEC) == 2 + 2


@pytest.mark.parametrize(("given", "message"), [
    ("word " * 15, "maximum input length is 16 tokens"),
    ([[30522]], "token ids of all-minilm-l6-v2 are 0 to 30521"),
])
def test_what_the_model_cannot_read_names_input(given: object, message: str) -> None:
    ask = normalize_embedding(generation(given))["embedding"]
    assert ask is not None
    with pytest.raises(InvalidRequest, match=message) as info:
        measure_inputs(ask, HfTokenizer("package:all_minilm_l6_v2"), SPEC)
    assert info.value.param == "input"


def test_a_forged_event_is_checked_again() -> None:
    g = generation("x")
    for inputs in ([], ["\x00"], [[]]):
        forged = {**g, "embedding": {**(g["embedding"] or {}), "inputs": inputs}}
        with pytest.raises(InvalidRequest):
            normalize_embedding(forged)  # type: ignore[arg-type]


def test_embeddings_go_to_embedding_models_and_chats_to_the_others() -> None:
    chat_model = ModelSpec(name="smollm2", pool="cpu", context_length=2048)
    with pytest.raises(InvalidRequest, match="does not serve embeddings"):
        check_kind(generation("x"), chat_model)
    with pytest.raises(InvalidRequest, match="is an embedding model") as info:
        check_kind(make_request([{"role": "user", "content": "hi"}])["generation"], SPEC)
    assert info.value.param == "model"
    check_kind(generation("x"), SPEC)
