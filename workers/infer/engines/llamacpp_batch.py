"""An engine that decodes its sequences together in batched llama.cpp contexts (CPU).

The one llama.cpp engine (``--engine llamacpp``; ``llamacpp-batch`` is its
former name). ``contexts`` batched contexts (default 2, one a core), each with
its share of the ``sequences`` and a thread of its own, advance all their
sequences with one ``llama_decode`` a step: each running sequence's last token
and at most ``prefill_chunk`` prompt tokens. Why, and what each choice
measured: docs/decisions/0007-batching.md, 0028-one-llama-cpp-engine.md.

* A new sequence goes to the least busy context, among equals to the one whose
  free slots hold the longest prefix of its prompt (of its own ``cache_salt``);
  a busier context wins only with a prefix longer by ``prefill_chunk`` tokens.
  The context's thread picks the slot (and host memory with
  ``host_cache_bytes``: llamacpp_cache); the reuse is ``cached_tokens``.
* Each sequence has ``n_ctx`` positions: a longer prompt is an
  :class:`~conveyor.errors.EngineError`, an answer that reaches it ends with
  ``length``. Greedy answers are the same alone or beside other streams;
  seeded samples may differ (docs/decisions/0009-same-answer-at-temperature-0.md).
* Each piece ``tokens=1``, the last carrying the rest of the tokens sampled; a
  chat preprocess did not render gets the GGUF's chat template. Failures
  inside llama.cpp surface from :meth:`generate` as EngineError (a request's
  own fault, a :class:`~conveyor.errors.RequestError`, as itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from conveyor.errors import EngineError, RequestError
from conveyor.registry import ModelSpec
from schemas import records
from workers.infer.engines.base import Engine, GenerationRequest, Piece
from workers.infer.engines.llamacpp_batch_context import (
    Context,
    Item,
    Sequence,
    chat_formatter,
)
from workers.infer.engines.llamacpp_cache import HostCache, kv_bytes_per_token
from workers.infer.engines.llamacpp_grammar import checked_prefix

__all__ = ["LlamaCppBatchEngine"]


class LlamaCppBatchEngine(Engine):
    """Serves ``sequences`` generations at once, decoded together in ``contexts``
    batched contexts of ``n_threads`` threads each."""

    name = "llamacpp"
    # a grammar sampler and llama.cpp's logit-bias sampler in each sequence's chain;
    # logprobs read off each sequence's logits (logprob_of)
    constrains_output = decodes_tools = biases_logits = reports_logprobs = True

    def __init__(
        self,
        model_path: Path,
        sequences: int = 8,
        contexts: int = 2,
        n_ctx: int = 2048,
        n_threads: int = 1,
        prefill_chunk: int = 128,
        host_cache_bytes: int = 0,
    ) -> None:
        if sequences < 1 or contexts < 1:
            raise ValueError("sequences and contexts must be at least 1")
        self.capacity = sequences
        self.contexts = min(contexts, sequences)  # a context holds one sequence at least
        self.reproducible_seeds = False  # see the module notes
        self.model_path = Path(model_path)
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.prefill_chunk = max(1, prefill_chunk)
        self._llm: Llama | None = None
        self._chat: Jinja2ChatFormatter | None = None
        self._contexts: list[Context] = []
        self._slots_free: asyncio.Semaphore | None = None
        # the KV caches of sequences their slots moved on from, for every context
        # (llamacpp_cache)
        self.host_cache = HostCache(host_cache_bytes) if host_cache_bytes > 0 else None
        self._token_bytes: int | None = None  # a token's KV, from the model's metadata

    @classmethod
    def from_spec(cls, spec: ModelSpec, sequences: int = 8, contexts: int = 2,
                  n_threads: int = 1, n_ctx: int | None = None,
                  host_cache_bytes: int = 0) -> LlamaCppBatchEngine:
        """An engine for a registry model: its GGUF file and context length."""
        return cls(spec.gguf_path(), sequences=sequences, contexts=contexts,
                   n_ctx=n_ctx or spec.context_length, n_threads=n_threads,
                   host_cache_bytes=host_cache_bytes)

    async def start(self) -> None:
        if self._contexts:
            return
        loop = asyncio.get_running_loop()
        executors = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-{i}")
                     for i in range(self.contexts)]
        contexts: list[Context] = []
        try:
            llm = self._llm = await loop.run_in_executor(executors[0], self._load_model)
            self._chat = chat_formatter(llm)
            self._token_bytes = kv_bytes_per_token(llm.metadata)
            shares = _shares(self.capacity, self.contexts)
            for executor, share in zip(executors, shares, strict=True):
                context = Context(llm, executor, share, self.n_ctx, self.n_threads,
                                   self.prefill_chunk, self.host_cache)
                contexts.append(context)
                await loop.run_in_executor(executor, context.load)
        except Exception as exc:
            await self._free(executors, contexts)
            raise EngineError(f"cannot load {self.model_path}: {exc}") from exc
        self._contexts = contexts
        self._slots_free = asyncio.Semaphore(self.capacity)
        for context in contexts:
            context.run()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        """Stream one answer, decoded beside the others (see the module notes)."""
        slots_free = self._slots_free
        if slots_free is None:
            raise EngineError(f"engine {self.name} is not started")
        tokens = self._tokens(self._prompt(request))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Item] = asyncio.Queue()

        def emit(item: Item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening
                sequence.cancelled = True

        sequence = Sequence(request, tokens, emit, accepted=self._accepted(request))
        await slots_free.acquire()
        try:
            context = self._route(tokens, request.cache_salt, reuse=request.seed is None)
        except EngineError:
            slots_free.release()
            raise
        context.assigned += 1
        try:
            context.submit(sequence)
            async for piece in pieces_from(queue):
                yield piece
        finally:
            sequence.cancelled = True
            context.assigned -= 1
            slots_free.release()

    def _prompt(self, request: GenerationRequest) -> str:
        if request.rendered is not None:
            return request.rendered
        if self._chat is None:
            raise EngineError(f"{self.model_path.name} has no chat template")
        return self._chat(messages=cast(Any, request.chat())).prompt + request.continuation

    def _accepted(self, request: GenerationRequest) -> list[int]:
        """A structured answer's continuation, as the tokens its grammar sampler
        takes before it samples (checked: llamacpp_grammar)."""
        fmt = request.response_format
        if fmt is None or not request.continuation:
            return []
        llm = cast(Llama, self._llm)
        tokens = llm.tokenize(request.continuation.encode("utf-8"), add_bos=False,
                              special=False)
        checked_prefix(llm._model.vocab, fmt, tokens)
        return tokens

    def _tokens(self, prompt: str) -> list[int]:
        llm = cast(Llama, self._llm)
        try:
            # an empty prompt (OpenAI takes "") is the beginning-of-sequence token:
            # llama.cpp cannot evaluate zero tokens, and a model whose tokenizer adds
            # no BOS itself (SmolLM2) would otherwise fail
            tokens = (llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True) if prompt
                      else [llm.token_bos()])
        except Exception as exc:
            raise EngineError(f"llama.cpp could not tokenize the prompt: {exc}") from exc
        if len(tokens) >= self.n_ctx:
            raise EngineError(f"the prompt's {len(tokens)} tokens do not fit the context "
                              f"window of {self.n_ctx} tokens a sequence has")
        return tokens

    def _route(self, tokens: list[int], salt: str, reuse: bool) -> Context:
        """The context a new sequence of ``salt`` joins (see the module notes)."""
        room = [c for c in self._contexts if c.assigned < c.share]
        if not room:  # the engine closed while the request waited
            raise EngineError(f"engine {self.name} is not started")
        gains = {c: c.reusable(tokens, salt) if reuse else 0 for c in room}
        least = min(c.assigned for c in room)
        idle = max((c for c in room if c.assigned == least), key=lambda c: gains[c])
        held = max(room, key=lambda c: (gains[c], -c.assigned))
        return held if gains[held] - gains[idle] >= self.prefill_chunk else idle

    def host_cache_stats(self) -> records.HostCache | None:
        """A copy of what the host cache did so far."""
        host = self.host_cache
        return None if host is None else records.HostCache(**host.stats)

    def cache_tokens(self) -> int | None:
        """What its caches hold at most: every slot's tokens, and
        its host cache's bytes as tokens of a model this size."""
        host, token_bytes = self.host_cache, self._token_bytes
        held = host.capacity_bytes // token_bytes if host is not None and token_bytes else 0
        return self.capacity * self.n_ctx + held

    def kv_state(self) -> records.KvCache | None:
        """All contexts' cells (a block is one token here): what running sequences
        hold, and the prefixes free slots keep for reuse; the prompt tokens of every
        sequence so far, and those taken from the caches instead of evaluated.
        Read from the event loop while the threads work, so a heartbeat may be a
        step behind."""
        if not self._contexts:
            return None
        total = self.capacity * self.n_ctx
        cells = [c.cells() for c in self._contexts]
        used, kept = sum(u for u, _ in cells), sum(k for _, k in cells)
        return records.KvCache(usage=used / total, total_blocks=total,
                               free_blocks=total - used, cached_blocks=kept, block_tokens=1,
                               prefix_queries=sum(c.prompt_tokens for c in self._contexts),
                               prefix_hits=sum(c.reused_tokens for c in self._contexts))

    async def close(self) -> None:
        """Cancel what runs, stop the threads, free the contexts and the model."""
        contexts = self._contexts
        if not contexts:
            return
        for context in contexts:
            context.stop()
        await asyncio.gather(*(cast(asyncio.Future[None], c.loop_done) for c in contexts),
                             return_exceptions=True)
        await self._free([c.executor for c in contexts], contexts)
        self._contexts = []
        self._slots_free = None

    def _load_model(self) -> Llama:
        # The Llama object owns the weights and the tokenizer; its own context is
        # a small idle one. The batched contexts are made from the same weights.
        return Llama(model_path=str(self.model_path), n_ctx=64, n_batch=64, n_threads=1,
                     verbose=False)

    async def _free(self, executors: list[ThreadPoolExecutor], contexts: list[Context]) -> None:
        """Every context freed on its thread, then the model on the first's."""
        loop = asyncio.get_running_loop()
        for context in contexts:
            await loop.run_in_executor(context.executor, context.free)
        if self._llm is not None:
            await loop.run_in_executor(executors[0], self._llm.close)
        self._llm = self._chat = None
        for executor in executors:
            executor.shutdown(wait=True)


async def pieces_from(queue: asyncio.Queue[Item]) -> AsyncGenerator[Piece, None]:
    """The pieces a context's thread puts on ``queue`` up to the last one; an
    exception it puts there is raised as an EngineError (a request's own fault,
    a RequestError, as itself)."""
    while True:
        item = await queue.get()
        if isinstance(item, (EngineError, RequestError)):
            raise item
        if isinstance(item, BaseException):
            raise EngineError(f"llama.cpp failed: {item}") from item
        yield item
        if item.finish_reason is not None:
            return


def _shares(sequences: int, contexts: int) -> list[int]:
    """``sequences`` dealt out over ``contexts``, the first ones taking the rest."""
    return [sequences // contexts + (i < sequences % contexts) for i in range(contexts)]


