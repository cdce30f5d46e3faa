"""``POST /v1/embeddings`` in OpenAI's shape: the body, the pipeline's
:class:`~schemas.records.Generation` made of it (one place, for the gateway and
for a batch's lines), and the answer built from the vectors.

``input`` is a string, a list of strings, a list of token ids or a list of
lists of token ids (from 1 to 2048 inputs, none empty); ``encoding_format``
``float`` (JSON numbers, float32's shortest form) or ``base64`` (the float32
bytes, little-endian: what the official client asks for and decodes);
``dimensions`` only as the model's width (all-MiniLM-L6-v2 was not trained to
be cut shorter); ``user`` is accepted and not kept. The rules:
docs/api/embeddings.md.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor.errors import InvalidRequest
from schemas.openai.fields import Text
from schemas.records import Embedding, EmbeddingAsk, Generation, Sampling, Usage

__all__ = ["EmbeddingBody", "MAX_INPUTS", "embedding_generation", "embedding_response",
           "most_inputs", "response_bytes_per_input", "too_many_inputs"]

# OpenAI's bounds: inputs a request, and a token id (its largest vocabulary's)
MAX_INPUTS = 2048
_MAX_TOKEN_ID = 2**31 - 1

TokenIds = list[Annotated[int, Field(ge=0, le=_MAX_TOKEN_ID)]]


class EmbeddingBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text = Field(min_length=1)
    input: Text | list[Text] | TokenIds | list[TokenIds] = Field(
        description="a text, a list of texts, token ids, or a list of lists of token ids")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=65536)] | None = None
    user: Text | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: str | list[Any]) -> str | list[Any]:
        """Every input is embedded or the request is refused: none empty."""
        if isinstance(value, str):
            if not value:
                raise ValueError("an empty string cannot be embedded")
            return value
        if not 1 <= len(value) <= MAX_INPUTS:
            raise ValueError(f"input holds {len(value)} items; from 1 to {MAX_INPUTS} are "
                             "allowed in one request")
        for i, item in enumerate(value):
            if (isinstance(item, str | list)) and not item:
                raise ValueError(f"input[{i}] is empty; an empty input cannot be embedded")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: a string, or token ids, is one input."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]


def embedding_generation(body: EmbeddingBody) -> Generation:
    """The pipeline's request for ``body`` (nothing is sampled: the sampling
    record holds its defaults)."""
    sampling = Sampling(temperature=1.0, top_p=1.0, max_tokens=None, stop=[], seed=None,
                        presence_penalty=0.0, frequency_penalty=0.0, logit_bias={},
                        logprobs=False, top_logprobs=0)
    return Generation(kind="embedding", model=body.model, messages=[], prompt=None,
                      sampling=sampling, stream=False, include_usage=False,
                      created=int(time.time()), store=False, metadata={}, api="embeddings",
                      response_format=None, tools=None,
                      embedding=EmbeddingAsk(inputs=body.inputs(),
                                             encoding_format=body.encoding_format,
                                             dimensions=body.dimensions))


def response_bytes_per_input(dimensions: int, encoding_format: str) -> int:
    """At most the bytes one input's entry takes in the answer: a float32 in
    JSON is at most 15 characters and a comma (``-1.2345678e-05,``); base64
    writes 4 characters for 3 bytes; 64 for the entry's object around it."""
    if encoding_format == "base64":
        return -(-dimensions * 4 // 3) * 4 + 64
    return dimensions * 16 + 64


def most_inputs(max_event_bytes: int, dimensions: int, encoding_format: str) -> int:
    """How many inputs' vectors one answer event holds (64 KB of it kept for
    the rest of the event)."""
    return max(1, (max_event_bytes - 64 * 1024)
               // response_bytes_per_input(dimensions, encoding_format))


def too_many_inputs(count: int, dimensions: int, encoding_format: str,
                    max_event_bytes: int) -> InvalidRequest | None:
    """The 400 for more inputs than one answer holds, naming the other format's
    bound; None when they fit."""
    most = most_inputs(max_event_bytes, dimensions, encoding_format)
    if count <= most:
        return None
    other = "base64" if encoding_format == "float" else "float"
    return InvalidRequest(
        f"Invalid 'input': the vectors of {count} inputs do not fit one answer; at most "
        f"{most} inputs a request with encoding_format {encoding_format!r} "
        f"({most_inputs(max_event_bytes, dimensions, other)} with {other!r}). Send them in "
        "several requests.", param="input")


def embedding_response(model: str, embeddings: list[Embedding], encoding_format: str,
                       usage: Usage) -> str:
    """OpenAI's answer: a list of ``embedding`` objects in the inputs' order."""
    import numpy as np

    data = []
    for e in sorted(embeddings, key=lambda e: e["index"]):
        vector: Any = base64.b64encode(e["vector"]).decode() if encoding_format == "base64" \
            else np.frombuffer(e["vector"], "<f4")
        data.append({"object": "embedding", "index": e["index"], "embedding": vector})
    body = {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": usage["prompt_tokens"],
                      "total_tokens": usage["prompt_tokens"]}}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY).decode()
