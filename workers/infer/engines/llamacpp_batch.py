"""An engine that decodes its sequences together in batched llama.cpp contexts (CPU).

Where :mod:`workers.infer.engines.llamacpp` gives every request a context of
its own, this engine keeps ``contexts`` batched contexts (default 2), each
with its share of the ``sequences`` and a thread of its own, and advances all
the sequences of a context with a single ``llama_decode`` per step.

Decisions:

* **Batched contexts, one thread each; one by default.** The weights are
  loaded once and mmapped; every context is made from the same model, so a
  context adds its compute buffers and a thread (see *Memory*). Two threads
  in one context collapsed whenever other work ran (4 tokens/s instead of
  37: llama.cpp's threads wait for each other at every operation); two
  contexts of one thread do not wait for each other. On the two cores here,
  with nothing else running, ``bench.engines --no-vllm --levels 1,4,8
  --batch-contexts 1,2`` measured one context against two, 16 sequences, at
  22.5/42.3/60.2 tokens/s against 22.5/52.5/86.8 at 1/4/8 streams: one
  context per core, ``--batches 2``, is the default. While other processes
  held the cores, two contexts made less than one (25.4/45.3/65.0 against
  20.7/32.7/55.3 at 1/4/8 streams, in a busy run): a second context splits
  the batch, and each reads the weights every step, without a second core
  to run it. Give ``--batches 1`` on a host whose other work keeps a core.
  ``n_threads`` is per context, as in ``LlamaCppEngine``.
* **Small batches want ggml's kernels, not tinyBLAS.** llama.cpp as
  released multiplies any batch of 2 tokens or more with tinyBLAS, which on
  this machine's CPU made a step of two sequences cost more than two steps
  of one (41-45 ms against 18), so two contexts of two sequences (four
  streams) made no more than today's engine. ``infra/llama.sh`` builds
  llama.cpp with batches under 5 tokens on ggml's own dot products (25-32 ms
  for two, 41-50 for four; ``GGML_SGEMM_MIN_N`` sets the bound): 0.86-0.94x
  of ``LlamaCppEngine`` at four streams became 1.33-1.40x, and 1.21-1.32x at
  eight became 1.61-1.73x (README, "Batching"). The same build's f16 dot
  product prefetches the weights' next rows and takes two rows by two tokens
  in a call (each sum in the same order, every logit bit for bit the same):
  a step of one sequence 29.8 to 23.5 ms, of two 38.6 to 28.1 ms, of four
  54.1 to 39.6 ms, and 1.45-1.51x at four streams, 1.99-2.06x at eight.
* **Each context's thread owns it.** Making the context, every decode and
  sampling, and freeing run on the context's one thread (a one-worker
  executor); the model itself is loaded and closed on the first context's.
  The loop sleeps while nothing runs; a step takes the sequences that joined
  since the last one, drops the cancelled, decodes, samples and streams the
  pieces back with ``loop.call_soon_threadsafe`` into each request's
  ``asyncio.Queue``. Sequences join and leave between steps, so closing a
  generator frees its sequence within one step. Prompts are tokenized on the
  event loop (the vocabulary is read-only, as llama.cpp's server tokenizes
  beside its decoding), so that the engine can route them.
* **Routing.** A new sequence goes to a context with room: to the least busy
  (fewest running sequences), among equally busy ones to the one whose free
  slots hold the longest prefix of its prompt tokens; a busier context wins
  it only when the prefix it holds is longer by ``prefill_chunk`` tokens or
  more. A shorter difference saves part of one step's prompt chunk, while
  one more sequence in the busier context slows its every step for the whole
  answer: a shared system prompt, which every slot soon holds, would
  otherwise pile every stream into the context that served it first and
  leave the other core idle. The contexts' slots are read from the event
  loop while their threads work, so the route is a hint; the context's
  thread then picks its slot from what it really holds.
* **A step is one batch.** Every running sequence of a context puts its last
  sampled token in; a sequence still reading its prompt puts in a chunk of
  it, at most ``prefill_chunk`` prompt tokens per step and context, so a
  long prompt delays the running streams by one chunk's evaluation a step,
  not its whole length. Only the last prompt token asks for logits.
* **One cache per context, a bound for each sequence.** A context's KV cache
  is unified: it holds ``share x n_ctx`` cells, and the engine keeps every
  sequence (with what its slot keeps cached) within ``n_ctx`` positions, so
  the cache never runs out; a prompt of ``n_ctx`` tokens or more is refused
  with an :class:`~conveyor.errors.EngineError`, and an answer that reaches
  ``n_ctx`` ends with ``length``. Not one cache per sequence: llama.cpp then
  splits every step into one batch per sequence, and 8 streams made 28
  tokens/s in all against 60 for one stream alone.
* **Memory.** The cells of all contexts together are ``sequences x n_ctx``
  whatever the split (SmolLM2-135M: 22.5 KiB a cell in f16, 30 layers of
  3 x 64 keys and values), so a second context adds no KV cache: measured
  at 16 sequences of 2048 tokens, one context holds a 720 MiB KV buffer and
  27.6 MiB of compute buffers, two hold 360 MiB and 26.1 MiB each; a context
  adds about 26 MiB and a thread (the process's resident memory after start:
  1.08 GB either way, most of the KV buffer not yet touched).
* **Prefix reuse.** A finished sequence's positions stay in its slot's cache.
  A new sequence takes the free slot of its context whose cache serves it
  best: the prefix it shares with the prompt tokens, less what the slot
  would throw away of the prompt it holds (``llamacpp_prompts.reuse_score``: a
  conversation's cache is not given up for the few template tokens every
  prompt shares, an empty or stale slot is taken instead), keeps those positions
  (removing the rest with ``llama_memory_seq_rm``) and evaluates only the
  remainder; at least the prompt's last token is always evaluated, for its
  logits. What is reused is exactly that: the longest common token prefix
  with what the slot last held (the previous prompt and the answer tokens
  that were decoded), or, with ``host_cache_bytes``, with a sequence some
  slot of the engine moved on from, kept in host memory and copied back
  into this slot (llamacpp_cache: the cells as the model computed them; a
  slot's sequence stays within ``n_ctx`` positions, so the cells it frees
  always make room for it). ``reused_tokens`` counts them, and the last
  piece reports them as ``cached_tokens``. Only prompts of the same salt
  (the request's ``cache_salt``, its tenant's) reuse each other's: a slot
  keeps the salt of what it holds, and a slot or saved sequence of another
  salt serves a prompt nothing, in routing as in reuse.
* **Temperature 0 means the same answer.** Measured on SmolLM2-135M: a greedy
  answer is the same alone, beside other streams, in either context, and with
  or without its prefix reused
  (tests/unit/workers/infer/engines/test_llamacpp_batch.py asks one question
  20 times beside other streams). A request with a ``seed`` still evaluates
  its prompt afresh, as :mod:`~workers.infer.engines.llamacpp` does, but **a
  seeded sample at a temperature gives up bit-for-bit repetition here**:
  a context's sequences share one KV cache, where their cells lie depends on
  what else is in it (running sequences, the prefixes free slots keep), and
  flash attention's sums over the cache round a little differently with that
  layout. Sampling turns the smallest difference in the logits into another
  token now and then: measured, a seeded question asked 12 times beside 0-3
  other streams got one answer 11 times and another once, while greedy got
  one answer 12 times. ``reproducible_seeds`` is False, and a seeded request
  that must repeat belongs on
  :class:`~workers.infer.engines.llamacpp.LlamaCppEngine` (a context per
  sequence) or vLLM.
* **Flash attention as llama.cpp chooses it** ("auto": on, on a CPU). With it
  off, 8 greedy streams of SmolLM2 made 5 tokens/s in all instead of 65 on
  two threads. The arithmetic differs from
  :class:`~workers.infer.engines.llamacpp.LlamaCppEngine`'s (off), so the two
  engines' greedy answers may part after some tokens; each is stable.
* **OpenAI sampling semantics.** A sampler chain per sequence: ``temperature
  <= 0`` is greedy; otherwise temperature, then ``top_p`` (over the
  distribution the temperature made, as OpenAI and vLLM apply them), then a
  draw with the request's seed folded into llama.cpp's seed space (a fresh
  random one without a seed). No ``top_k`` or ``min_p``. The presence and
  frequency penalties come first in the chain, over the sequence's last
  64 sampled tokens, as llama-cpp-python applies them.
* **Text.** Token bytes go through an incremental UTF-8 decoder, so a
  character split over tokens is sent whole. Text that may be the start of a
  stop string is held back; an answer ends before the first stop string.
* **Token counts.** Each streamed piece is ``tokens=1``; the last piece
  carries the difference to the number of tokens sampled (the
  end-of-generation token counted), so the pieces add up to the true usage.
* Prompts are rendered as :class:`~workers.infer.engines.llamacpp.LlamaCppEngine`
  renders them (the GGUF's chat template when preprocess sent none; any
  continuation appended; an empty prompt starts at the BOS token). Every
  failure inside llama.cpp surfaces from :meth:`generate` as an
  :class:`~conveyor.errors.EngineError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from conveyor.errors import EngineError
from conveyor.registry import ModelSpec
from workers.infer.engines.base import GenerationRequest, HostCacheStats, KvState, Piece
from workers.infer.engines.llamacpp import pieces_from
from workers.infer.engines.llamacpp_batch_context import Context, Item, Sequence
from workers.infer.engines.llamacpp_cache import (
    HostCache,
    held_tokens,
    kv_bytes_per_token,
    stats_of,
)
from workers.infer.engines.llamacpp_grammar import checked_prefix
from workers.infer.engines.llamacpp_prompts import chat_formatter, prompt_or_bos

__all__ = ["LlamaCppBatchEngine"]


class LlamaCppBatchEngine:
    """Serves ``sequences`` generations at once, decoded together in ``contexts``
    batched contexts of ``n_threads`` threads each."""

    def __init__(
        self,
        model_path: Path,
        sequences: int = 8,
        contexts: int = 2,
        n_ctx: int = 2048,
        n_threads: int = 1,
        prefill_chunk: int = 128,
        name: str = "llamacpp-batch",
        host_cache_bytes: int = 0,
    ) -> None:
        if sequences < 1 or contexts < 1:
            raise ValueError("sequences and contexts must be at least 1")
        self.name = name
        self.capacity = sequences
        self.constrains_output = True  # a grammar sampler in each sequence's chain
        self.decodes_tools = True  # the same sampler, on the tools' grammar
        self.biases_logits = True  # llama.cpp's logit-bias sampler, first in each chain
        self.reports_logprobs = True  # read off each sequence's logits (logprobs.py)
        # the pool's models, all of them loaded (base.Engine)
        self.served: list[str] | None = None
        self.loaded: list[str] | None = None
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

    @property
    def reused_tokens(self) -> int:
        """Prompt tokens taken from the caches instead of evaluated, so far."""
        return sum(c.reused_tokens for c in self._contexts)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of every sequence so far, reused or not."""
        return sum(c.prompt_tokens for c in self._contexts)

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
        if request.prompt_text is not None or request.kind == "completion":
            return (request.prompt_text or "") + request.continuation
        if self._chat is None:
            raise EngineError(f"{self.model_path.name} has no chat template")
        messages = [{"role": m["role"], "content": m["content"]} for m in request.messages]
        return self._chat(messages=cast(Any, messages)).prompt + request.continuation

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
            given = prompt_or_bos(llm, prompt)
            tokens = (given if isinstance(given, list)
                      else llm.tokenize(given.encode("utf-8"), add_bos=True, special=True))
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

    def host_cache_stats(self) -> HostCacheStats | None:
        return stats_of(self.host_cache)

    def cache_tokens(self) -> int | None:
        """Every slot's tokens, and its host cache's (base.HoldsPrompts)."""
        return held_tokens(self.capacity * self.n_ctx, self.host_cache, self._token_bytes)

    def kv_state(self) -> KvState | None:
        """All contexts' cells (a block is one token here): what running sequences
        hold, and the prefixes free slots keep for reuse. Read from the event loop
        while the threads work, so a heartbeat may be a step behind."""
        if not self._contexts:
            return None
        total = self.capacity * self.n_ctx
        cells = [c.cells() for c in self._contexts]
        used, kept = sum(u for u, _ in cells), sum(k for _, k in cells)
        return KvState(usage=used / total, total_blocks=total, free_blocks=total - used,
                       cached_blocks=kept, block_tokens=1, prefix_queries=self.prompt_tokens,
                       prefix_hits=self.reused_tokens)

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


def _shares(sequences: int, contexts: int) -> list[int]:
    """``sequences`` dealt out over ``contexts``, the first ones taking the rest."""
    return [sequences // contexts + (i < sequences % contexts) for i in range(contexts)]


