"""The embeddings body in its four input forms, what it refuses, and the answer
built from float32 vectors."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from pydantic import ValidationError

from schemas.openai.embeddings import (
    EmbeddingBody,
    embedding_generation,
    embedding_response,
    response_bytes_per_input,
)
from schemas.records import Embedding, Usage


@pytest.mark.parametrize(("given", "inputs"), [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_every_input_form_is_a_list_of_inputs(given: object, inputs: list[object]) -> None:
    body = EmbeddingBody.model_validate({"model": "m", "input": given, "user": "u"})
    assert body.inputs() == inputs
    generation = embedding_generation(body)
    assert generation["kind"] == "embedding" and generation["api"] == "embeddings"
    assert generation["embedding"] == {"inputs": inputs, "encoding_format": "float",
                                       "dimensions": None}


@pytest.mark.parametrize("given", ["", [], ["a", ""], [[1], []], [-1], ["x"] * 2049, [1.5],
                                   ["a", 1]])
def test_what_cannot_be_embedded_is_refused(given: object) -> None:
    with pytest.raises(ValidationError):
        EmbeddingBody.model_validate({"model": "m", "input": given})


def test_the_answer_in_float_and_base64() -> None:
    vectors = np.asarray([[0.5, -0.25, 1e-7], [1.0, 0.0, -1.0]], "<f4")
    embeddings = [Embedding(index=1, vector=vectors[1].tobytes()),
                  Embedding(index=0, vector=vectors[0].tobytes())]
    usage = Usage(prompt_tokens=7, completion_tokens=0)
    floats = json.loads(embedding_response("m", embeddings, "float", usage))
    assert floats["object"] == "list" and floats["model"] == "m"
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert np.asarray([d["embedding"] for d in floats["data"]], "<f4").tobytes() == \
        vectors.tobytes()
    b64 = json.loads(embedding_response("m", embeddings, "base64", usage))
    assert base64.b64decode(b64["data"][0]["embedding"]) == vectors[0].tobytes()


def test_an_entry_never_takes_more_than_its_bound() -> None:
    worst = np.asarray([-1.2345678e-05, -3.4028235e38, 1.1754944e-38, -0.12345678] * 96, "<f4")
    entry = [Embedding(index=2047, vector=worst.tobytes())]
    usage = Usage(prompt_tokens=1, completion_tokens=0)
    for fmt in ("float", "base64"):
        body = embedding_response("m", entry, fmt, usage)
        head = len(embedding_response("m", [], fmt, usage))
        assert len(body) - head <= response_bytes_per_input(384, fmt)
