"""An embedding request checked and measured (preprocess): its inputs in NFC
without NULs, none empty; each counted with the model's tokenizer ([CLS] and
[SEP] included, as the encoder reads it) and refused with a 400 naming
``input`` when it is longer than the model takes (OpenAI refuses an over-long
input rather than cut it); the width asked for held to the model's."""

from __future__ import annotations

import hashlib
import json

from conveyor.errors import InvalidRequest
from conveyor.registry import ModelSpec
from schemas.openai.embeddings import MAX_INPUTS
from schemas.records import EmbeddingAsk, Generation
from workers.preprocess.normalize import normalize_text
from workers.preprocess.tokenizers import Tokenizer

__all__ = ["MAX_INPUTS", "SPECIAL_TOKENS", "check_kind", "embedding_fingerprint",
           "measure_inputs", "normalize_embedding"]

# [CLS] and [SEP], around every input
SPECIAL_TOKENS = 2


def normalize_embedding(generation: Generation) -> Generation:
    """Validate an embedding request; a copy whose texts are normalised."""
    ask = generation.get("embedding")
    if ask is None or not isinstance(ask.get("inputs"), list) or not ask["inputs"]:
        raise InvalidRequest("Invalid 'input': give a string, a list of strings or token "
                             "ids, at least one.", param="input")
    if len(ask["inputs"]) > MAX_INPUTS:
        raise InvalidRequest(f"Invalid 'input': at most {MAX_INPUTS} inputs a request, not "
                             f"{len(ask['inputs'])}.", param="input")
    if ask.get("encoding_format") not in ("float", "base64"):
        raise InvalidRequest("Invalid 'encoding_format': 'float' or 'base64'.",
                             param="encoding_format")
    inputs: list[str | list[int]] = []
    for i, item in enumerate(ask["inputs"]):
        if isinstance(item, str):
            text = normalize_text(item, f"input[{i}]")
            if not text:
                raise InvalidRequest(f"Invalid 'input[{i}]': an empty string cannot be "
                                     "embedded.", param="input")
            inputs.append(text)
        elif isinstance(item, list) and item and all(
                isinstance(t, int) and t >= 0 for t in item):
            inputs.append(item)
        else:
            raise InvalidRequest(f"Invalid 'input[{i}]': a string or a non-empty list of "
                                 "token ids.", param="input")
    return {**generation, "embedding": EmbeddingAsk(
        inputs=inputs, encoding_format=ask["encoding_format"],
        dimensions=ask.get("dimensions"))}


def check_kind(generation: Generation, spec: ModelSpec) -> None:
    """An embedding request for an embedding model, a generation for the others."""
    asked = generation["model"]
    if generation["kind"] == "embedding" and spec.kind != "embedding":
        raise InvalidRequest(f"The model `{asked}` does not serve embeddings: ask an "
                             "embedding model.", param="model")
    if generation["kind"] != "embedding" and spec.kind == "embedding":
        raise InvalidRequest(f"The model `{asked}` is an embedding model: it serves "
                             "POST /v1/embeddings only.", param="model")


def measure_inputs(ask: EmbeddingAsk, tokenizer: Tokenizer, spec: ModelSpec) -> int:
    """The tokens of every input together, each within the model's length."""
    total = 0
    vocab = tokenizer.vocab_size
    for i, item in enumerate(ask["inputs"]):
        if isinstance(item, str):
            tokens = tokenizer.count(item) + SPECIAL_TOKENS
        else:
            if vocab is not None and max(item) >= vocab:
                raise InvalidRequest(f"Invalid 'input[{i}]': token ids of {spec.name} are 0 "
                                     f"to {vocab - 1}.", param="input")
            tokens = len(item) + SPECIAL_TOKENS
        if tokens > spec.context_length:
            raise InvalidRequest(f"This model's maximum input length is {spec.context_length} "
                                 f"tokens, however input[{i}] has {tokens} tokens. Please "
                                 "reduce the input's length.", param="input",
                                 code="context_length_exceeded")
        total += tokens
    return total


def embedding_fingerprint(model: str, ask: EmbeddingAsk) -> str:
    """sha256 (hex, first 32) of the model and the exact inputs."""
    material = json.dumps(ask["inputs"], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(model.encode() + b"\x00" + material.encode()).hexdigest()[:32]
