"""The contract every engine adapter keeps.

An engine turns one :class:`GenerationRequest` into a stream of
:class:`Piece` objects. It runs several requests at once (``capacity``);
the infer worker never asks for more than that. Closing the async iterator
(``aclose()``, or breaking out of ``async for``) cancels the generation and
frees its slot promptly.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import asdict, dataclass, field
from typing import Literal, Protocol, runtime_checkable

from schemas.records import Message, ResponseFormat, TokenLogprob

__all__ = ["GenerationRequest", "Piece", "Engine", "HoldsPrompts", "HostCacheStats",
           "KeepsHostCache", "KvState", "host_cache_counts"]


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
    # OpenAI's logit_bias: (token id, bias -100..100) pairs; only an engine that
    # ``biases_logits`` is given any
    logit_bias: tuple[tuple[int, float], ...] = ()
    # report each token's log probability, and this many alternatives; only an
    # engine that ``reports_logprobs`` is asked
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt rendered with the model's chat template (set by preprocess
    # when the tokenizer is local; always set for completions).
    prompt_text: str | None = None
    messages: tuple[Message, ...] = field(default_factory=tuple)
    # Text an earlier attempt already produced and sent: the engine continues
    # after it instead of starting a different answer.
    continuation: str = ""
    upstream_model: str | None = None
    # the structure the answer must have (schemas/structured.py); None: free text.
    # Only an engine that ``constrains_output`` is given one; a ``tool_calls``
    # format (schemas/tools.py) only one that ``decodes_tools``.
    response_format: ResponseFormat | None = None
    # whose cached prefixes the prompt may reuse: only those cached under the
    # same salt (the tenant's, workers/prefix.tenant_salt); "" where caches are
    # shared across tenants. vLLM's cache_salt; the llama.cpp engines' contexts
    # and host cache keep a prefix's salt beside its tokens
    cache_salt: str = ""


@dataclass(frozen=True)
class Piece:
    text: str
    tokens: int = 1
    finish_reason: Literal["stop", "length"] | None = None
    # on the last piece, where the engine knows them (vLLM): the prompt's tokens
    # and how many of them its prefix cache held
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # with logprobs asked for: the tokens this piece (and any text held back
    # before it) adds, in order
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class KvState:
    """What an engine's KV cache holds now, for the worker's heartbeat (engines
    that keep one in process: vLLM, the batching llama.cpp engine)."""

    usage: float  # the share of the cache the running sequences hold, 0..1
    total_blocks: int
    free_blocks: int  # not held by a running sequence (cached prefixes count as free)
    cached_blocks: int | None  # free, and holding a prefix a new prompt may reuse
    block_tokens: int  # tokens a block holds
    prefix_queries: int  # prompt tokens looked up in the prefix cache since the start
    prefix_hits: int  # of them, found there


class Engine(Protocol):
    name: str
    capacity: int
    # it decodes within a request's response_format (a JSON object, a JSON
    # Schema); a structured request on an engine that does not is refused
    constrains_output: bool
    # it decodes a request's tools (schemas/tools.py): calls held to the
    # functions' grammar; tools on an engine that does not are refused
    decodes_tools: bool
    # it adds a request's logit_bias to its logits; one that does not refuses it
    biases_logits: bool
    # it reports each token's log probability (Piece.logprobs)
    reports_logprobs: bool

    @property
    def served(self) -> list[str] | None:
        """The models it serves (a model set's, vLLM's one); None: its pool's."""
        ...

    @property
    def loaded(self) -> list[str] | None:
        """Of those, the ones loaded now; None: all of them."""
        ...

    def kv_state(self) -> KvState | None:
        """The KV cache now, or None where the engine keeps none Conveyor can see."""
        ...

    async def start(self) -> None:
        """Load the model (warm) before the worker joins its pool."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        """Stream the answer; the last piece carries a finish_reason."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class HoldsPrompts(Protocol):
    """An engine whose caches hold prompts without KV blocks the worker can see
    (llama.cpp's contexts, and the host memory behind them): the worker reports
    no more of the prompts it ran than they can hold."""

    def cache_tokens(self) -> int | None:
        """The tokens its caches hold at most; None: it cannot say."""
        ...


@dataclass
class HostCacheStats:
    """What a llama.cpp engine's host-memory cache did (llamacpp_cache), for metrics."""

    saved: int = 0  # sequences copied out
    restored: int = 0  # sequences copied back in
    evicted: int = 0  # dropped for room
    held_bytes: int = 0
    entries: int = 0


@runtime_checkable
class KeepsHostCache(Protocol):
    """An engine that keeps KV caches in host memory behind its contexts."""

    def host_cache_stats(self) -> HostCacheStats | None:
        """Its counts so far; None: it keeps none (switched off)."""
        ...


def host_cache_counts(engine: Engine) -> Callable[[], dict[str, int] | None] | None:
    """The engine's host-cache counts as a mapping, read at each metrics scrape;
    None for an engine that keeps no host cache."""
    if not isinstance(engine, KeepsHostCache):
        return None
    keeper = engine

    def read() -> dict[str, int] | None:
        stats = keeper.host_cache_stats()
        return None if stats is None else asdict(stats)

    return read
