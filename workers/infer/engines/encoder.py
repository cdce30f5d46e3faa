"""The encoder engine: an embedding model (a BERT encoder such as
all-MiniLM-L6-v2) in this process, on the CPU, over numpy (workers/infer/engines/bert.py).

It embeds; it does not generate. Requests that arrive while a batch runs wait
and go together into the next one (up to ``max_batch_inputs`` inputs), so many
small requests cost about what one request of all their inputs does. One
batch runs at a time, in a worker thread, with ``threads`` BLAS threads (one
by default). Why this engine: docs/decisions/0034-embeddings.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from conveyor.errors import ConveyorError, EngineError, InvalidRequest
from workers.infer.engines.base import EmbeddingRequest, Engine, GenerationRequest, Piece

if TYPE_CHECKING:
    from conveyor.registry import ModelSpec
    from workers.infer.engines.bert import BertEncoder

__all__ = ["EncoderEngine"]

# the inputs one forward batch takes at most, of however many requests
_MAX_BATCH_INPUTS = 256
# a request of more inputs than this is tokenized in a worker thread
_INLINE_INPUTS = 32


@dataclass
class _Waiting:
    request: EmbeddingRequest
    ids: list[list[int]]
    done: asyncio.Future[np.ndarray] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class EncoderEngine(Engine):
    """Serves one embedding model (its registry entry's ``weights``)."""

    name = "encoder"
    constrains_output = decodes_tools = biases_logits = reports_logprobs = False
    embeds = True

    def __init__(self, spec: ModelSpec, capacity: int = 8, threads: int = 1,
                 max_batch_inputs: int = _MAX_BATCH_INPUTS) -> None:
        if not spec.weights:
            raise ConveyorError(f"model {spec.name} has no weights to embed with")
        self.spec = spec
        self.capacity = capacity
        self.threads = threads
        self.max_batch_inputs = max_batch_inputs
        self._encoder: BertEncoder | None = None
        self._queue: list[_Waiting] = []
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None

    @property
    def served(self) -> list[str] | None:
        return [self.spec.name]

    async def start(self) -> None:
        self._encoder, self._tokenizer = await asyncio.to_thread(self._load)
        self._runner = asyncio.create_task(self._run(), name="encoder-batches")

    def _load(self) -> tuple[BertEncoder, object]:
        from workers.infer.engines.bert import load_encoder

        encoder, tokenizer = load_encoder(self.spec.weights or "", self.threads)
        encoder.embed([[101, 102]])  # the first forward pass allocates: not a client's
        return encoder, tokenizer

    @property
    def dimensions(self) -> int:
        assert self._encoder is not None, "start() loads the model"
        return self._encoder.dimensions

    def token_ids(self, request: EmbeddingRequest) -> list[list[int]]:
        """Each input's ids as the model reads them: a text tokenized (with
        [CLS] and [SEP]), given ids with [CLS] and [SEP] put around them."""
        from tokenizers import Tokenizer

        tokenizer = self._tokenizer
        assert isinstance(tokenizer, Tokenizer)
        cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        assert cls_id is not None and sep_id is not None, "a BERT vocabulary has both"
        texts = [i for i in request.inputs if isinstance(i, str)]
        encoded = iter(tokenizer.encode_batch(texts, add_special_tokens=True)) if texts \
            else iter(())
        out: list[list[int]] = []
        vocab = tokenizer.get_vocab_size()
        for i, item in enumerate(request.inputs):
            if isinstance(item, str):
                out.append(list(next(encoded).ids))
                continue
            if any(not 0 <= t < vocab for t in item):
                raise InvalidRequest(f"Invalid 'input[{i}]': token ids must be within the "
                                     f"model's vocabulary (0 to {vocab - 1}).", param="input")
            out.append([cls_id, *item, sep_id])
        return out

    async def embed(self, request: EmbeddingRequest) -> np.ndarray:
        if request.dimensions is not None and request.dimensions != self.dimensions:
            raise InvalidRequest(f"The model `{request.model}` does not support specifying "
                                 f"dimensions other than {self.dimensions}.",
                                 param="dimensions")
        # many inputs are tokenized off the event loop (the worker's heartbeats run there)
        ids = await asyncio.to_thread(self.token_ids, request) \
            if len(request.inputs) > _INLINE_INPUTS else self.token_ids(request)
        longest = max((len(i) for i in ids), default=0)
        if longest > self.spec.context_length:
            raise InvalidRequest(f"This model's maximum input length is "
                                 f"{self.spec.context_length} tokens; an input has {longest}.",
                                 param="input")
        waiting = _Waiting(request, ids)
        self._queue.append(waiting)
        self._wake.set()
        return await waiting.done

    async def _run(self) -> None:
        """Batches of the waiting requests, one at a time (see the module)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch: list[_Waiting] = []
                count = 0
                while self._queue and (not batch or count + len(self._queue[0].ids)
                                       <= self.max_batch_inputs):
                    waiting = self._queue.pop(0)
                    if not waiting.done.cancelled():
                        batch.append(waiting)
                        count += len(waiting.ids)
                if batch:
                    await self._forward(batch)

    async def _forward(self, batch: list[_Waiting]) -> None:
        assert self._encoder is not None
        ids = [i for w in batch for i in w.ids]
        try:
            vectors = await asyncio.to_thread(self._encoder.embed, ids)
        except Exception as exc:  # the model failed, not the request: a 500, retried
            for w in batch:
                if not w.done.done():
                    w.done.set_exception(EngineError(f"the encoder failed: {exc}"))
            return
        start = 0
        for w in batch:
            if not w.done.done():
                w.done.set_result(vectors[start:start + len(w.ids)])
            start += len(w.ids)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        raise InvalidRequest(f"The model `{request.model}` is an embedding model: it serves "
                             "POST /v1/embeddings, not generations.", param="model")
        yield Piece("")  # pragma: no cover - an async generator that raises

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        for w in self._queue:
            if not w.done.done():
                w.done.set_exception(EngineError("the encoder engine closed"))
        self._queue.clear()
