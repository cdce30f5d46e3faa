"""The contract every engine adapter keeps.

An engine turns one :class:`GenerationRequest` into a stream of
:class:`Piece` objects. It runs several requests at once (``capacity``);
the infer worker never asks for more than that. Closing the async iterator
(``aclose()``, or breaking out of ``async for``) cancels the generation and
frees its slot promptly.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, cast

from conveyor.errors import EngineError, InvalidRequest
from schemas.images import text_pieces
from schemas.records import HostCache, KvCache, Message, ResponseFormat, TokenLogprob

if TYPE_CHECKING:
    import numpy as np

__all__ = ["EmbeddingRequest", "GenerationRequest", "ImageInput", "Piece", "Engine",
           "host_cache_counts", "message_parts"]


@dataclass(frozen=True)
class ImageInput:
    """An image of a message, with its bytes, where it stands among the texts."""

    media_type: str
    data: bytes
    detail: str = "auto"


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
    # the bytes of the messages' images (their ImageRefs), by sha256; only an
    # engine that ``sees_images`` is given a request with images
    images: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def rendered(self) -> str | None:
        """The prompt the answer continues, the continuation after it: a
        completion's, or a chat's that preprocess rendered; None: a chat for
        the engine to render with the model's chat template."""
        if self.prompt_text is None and self.kind == "chat":
            return None
        return (self.prompt_text or "") + self.continuation

    def chat(self) -> list[dict[str, str]]:
        """The messages' roles and texts, as a chat template takes them."""
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]


def message_parts(message: Message, images: Mapping[str, bytes]) -> list[str | ImageInput]:
    """A message's content as its parts in the order they were sent: texts and
    images (each where its ``offset`` puts it in the text)."""
    refs = message.get("images") or []
    pieces = text_pieces(message["content"], refs)
    parts: list[str | ImageInput] = []
    for piece, ref in zip(pieces, refs, strict=False):
        data = images.get(ref["sha256"])
        if data is None:
            raise EngineError(f"the image of {ref.get('part') or 'a message'} was not read "
                              "from the file store")
        if piece:
            parts.append(piece)
        parts.append(ImageInput(ref["media_type"], data, ref.get("detail") or "auto"))
    if pieces[-1] or not parts:
        parts.append(pieces[-1])
    return parts


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
class EmbeddingRequest:
    """Inputs to embed: each a text, or token ids of the model's vocabulary
    (the engine adds the model's special tokens around them)."""

    request_id: str
    model: str  # the registry's canonical name
    inputs: tuple[str | tuple[int, ...], ...]
    # the vector's width asked for; None: the model's
    dimensions: int | None = None
    upstream_model: str | None = None  # the name an HTTP upstream knows the model by


class Engine(Protocol):
    """What an engine provides. One that subclasses it explicitly inherits the
    defaults: it serves its pool's models, all loaded, with no KV cache the
    worker can see."""

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
    # it embeds (``embed``); an embedding request to one that does not is refused
    embeds: bool = False
    # it reads the images of messages (GenerationRequest.images); a request with
    # images to one that does not is refused, naming the first image part
    sees_images: bool = False

    @property
    def served(self) -> list[str] | None:
        """The models it serves (a model set's, vLLM's one); None: its pool's."""
        return None

    @property
    def loaded(self) -> list[str] | None:
        """Of those, the ones loaded now; None: all of them."""
        return None

    def kv_state(self) -> KvCache | None:
        """The KV cache now (as the heartbeat carries it: what the running
        sequences hold, and the prefix cache's blocks and lookups), or None
        where the engine keeps none Conveyor can see (vLLM and the llama.cpp
        engine keep one in process)."""
        return None

    def cache_tokens(self) -> int | None:
        """The tokens its caches hold at most, where they hold prompts without KV
        blocks the worker can see (llama.cpp's contexts, and the host memory
        behind them): the worker reports no more of the prompts it ran than
        they can hold. None: it cannot say."""
        return None

    def host_cache_stats(self) -> HostCache | None:
        """What its KV caches in host memory (llamacpp_cache) did so far, as the
        heartbeat carries them; None: it keeps none."""
        return None

    async def start(self) -> None:
        """Load the model (warm) before the worker joins its pool."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        """Stream the answer; the last piece carries a finish_reason."""
        ...

    async def embed(self, request: EmbeddingRequest) -> np.ndarray:
        """One unit-length float32 vector per input, as an ``(inputs, width)``
        array in the inputs' order."""
        raise InvalidRequest(f"The {self.name} engine does not serve embeddings.",
                             param="model")

    async def close(self) -> None: ...


def host_cache_counts(engine: Engine) -> Callable[[], Mapping[str, int] | None]:
    """The engine's host-cache counts (every one an int), read at each metrics
    scrape: None while it keeps none."""
    return cast(Callable[[], Mapping[str, int] | None], engine.host_cache_stats)
