"""The contract every engine adapter keeps.

An engine turns one :class:`GenerationRequest` into a stream of
:class:`Piece` objects. It runs several requests at once (``capacity``);
the infer worker never asks for more than that. Closing the async iterator
(``aclose()``, or breaking out of ``async for``) cancels the generation and
frees its slot promptly.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from schemas.records import Message

__all__ = ["GenerationRequest", "Piece", "Engine"]


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    kind: Literal["chat", "completion"]
    model: str  # the registry's canonical name
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # OpenAI's penalties (-2..2): on tokens already present in the answer, and per
    # occurrence of them
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The prompt rendered with the model's chat template (set by preprocess
    # when the tokenizer is local; always set for completions).
    prompt_text: str | None = None
    messages: tuple[Message, ...] = field(default_factory=tuple)
    # Text an earlier attempt already produced and sent: the engine continues
    # after it instead of starting a different answer.
    continuation: str = ""
    upstream_model: str | None = None


@dataclass(frozen=True)
class Piece:
    text: str
    tokens: int = 1
    finish_reason: Literal["stop", "length"] | None = None
    # on the last piece, where the engine knows them (vLLM): the prompt's tokens
    # and how many of them its prefix cache held
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


class Engine(Protocol):
    name: str
    capacity: int

    async def start(self) -> None:
        """Load the model (warm) before the worker joins its pool."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        """Stream the answer; the last piece carries a finish_reason."""
        ...

    async def close(self) -> None: ...
