"""The encoder engine on the packaged all-MiniLM-L6-v2 (no service): its vectors
against the torch reference (computed once, the first six values kept here),
and the properties any sentence embedding has."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from conveyor.encoder_files import EncoderFiles, locate_weights
from conveyor.errors import InvalidRequest
from conveyor.registry import ModelSpec
from workers.infer.engines.base import EmbeddingRequest
from workers.infer.engines.bert import BertEncoder
from workers.infer.engines.encoder import EncoderEngine

SPEC = ModelSpec(name="all-minilm-l6-v2", pool="embed", context_length=256, kind="embedding",
                 tokenizer="hf", weights="package:all_minilm_l6_v2", dimensions=384)
# transformers 5.19 on torch 2.13, float32, mean-pooled and L2-normalised as
# sentence-transformers computes them
REFERENCE = {
    "The cat sits on the mat.": [0.134177, -0.0329, -0.024804, 0.041439, -0.036348, 0.041814],
    "Quarterly revenue rose by ten percent.": [0.003003, -0.050654, -0.010866, -0.06039,
                                               0.036113, 0.015231],
}


@pytest.fixture(scope="module")
def model() -> tuple[BertEncoder, EncoderFiles]:
    files = EncoderFiles(locate_weights(SPEC.weights or ""))
    return BertEncoder(files.config(), files.weights()), files


@pytest.fixture
async def engine() -> AsyncIterator[EncoderEngine]:
    made = EncoderEngine(SPEC, max_batch_inputs=64)
    await made.start()
    try:
        yield made
    finally:
        await made.close()


def embed(model: tuple[BertEncoder, EncoderFiles], texts: list[str]) -> np.ndarray:
    encoder, files = model
    return encoder.embed([e.ids for e in files.tokenizer().encode_batch(texts)])


def test_the_vectors_are_the_torch_references(model: tuple[BertEncoder, EncoderFiles]) -> None:
    got = embed(model, list(REFERENCE))
    assert got.shape == (2, 384) and got.dtype == np.float32
    assert np.abs(got[:, :6] - np.asarray(list(REFERENCE.values()))).max() < 2e-6


def test_unit_length_similar_closer_than_unrelated_and_deterministic(
        model: tuple[BertEncoder, EncoderFiles]) -> None:
    texts = ["A man is playing a guitar.", "Someone plays the guitar.",
             "The stock market fell sharply today.", "Ünïcödé straße 東京 🙂"]
    v = embed(model, texts)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.7 and max(v[0] @ v[2], v[1] @ v[2]) < 0.2
    assert embed(model, texts).tobytes() == v.tobytes()


def test_a_batch_is_its_inputs_one_by_one(model: tuple[BertEncoder, EncoderFiles]) -> None:
    texts = ["short", "a somewhat longer sentence about the weather in spring",
             "word " * 120, "x"]
    batch = embed(model, texts)
    alone = np.stack([embed(model, [t])[0] for t in texts])
    assert np.abs(batch - alone).max() < 1e-5


async def test_token_ids_are_their_text_and_requests_together_keep_their_own(
        engine: EncoderEngine) -> None:
    text = EmbeddingRequest("r1", SPEC.name, ("hello world", "hello"))
    ids = EmbeddingRequest("r2", SPEC.name, ((7592, 2088),))
    a, b = await asyncio.gather(engine.embed(text), engine.embed(ids))  # one batch
    assert a.shape == (2, 384) and b.shape == (1, 384)
    assert np.abs(a[0] - b[0]).max() < 1e-6 and a[0] @ a[1] < 0.99


@pytest.mark.parametrize(("inputs", "dimensions", "param"), [
    (("hi",), 128, "dimensions"),
    (("word " * 300,), None, "input"),
    (((30522,),), None, "input"),
])
async def test_what_the_model_cannot_do_is_a_400(
        engine: EncoderEngine, inputs: tuple[str | tuple[int, ...], ...],
        dimensions: int | None, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        await engine.embed(EmbeddingRequest("r", SPEC.name, inputs, dimensions))
    assert info.value.param == param
    assert (await engine.embed(EmbeddingRequest("r", SPEC.name, ("hi",), 384))).shape == (1, 384)
