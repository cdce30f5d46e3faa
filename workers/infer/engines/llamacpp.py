"""An engine that runs a GGUF model in-process with llama-cpp-python (CPU).

Decisions:

* **One context per concurrent request.** The engine keeps ``contexts``
  ``llama_cpp.Llama`` instances of the same file (the weights are mmapped, so
  they share memory; each has its own KV cache) and serves at most that many
  requests at once: ``capacity == contexts``. A free context is taken from an
  ``asyncio.Queue`` and always put back (``finally``).
* **One thread per context.** Each context owns a single-thread executor and
  is only ever touched from it. llama.cpp blocks for the whole generation, so
  the thread streams the pieces back with ``loop.call_soon_threadsafe`` into a
  per-request ``asyncio.Queue``. Because a context's executor runs one job at a
  time, the context can be returned to the free pool the moment the consumer
  goes away: a next job simply queues behind the finishing one.
* **Cancellation within one token.** Closing the generator sets a
  ``threading.Event``; a stopping criterion checks it after every sampled token
  and the streaming loop checks it after every chunk. Only the prompt's
  evaluation (one ``llama_decode`` call) cannot be interrupted.
* **OpenAI sampling semantics.** Only ``temperature`` and ``top_p`` shape the
  distribution: llama.cpp's extra ``top_k=40`` and ``min_p=0.05`` defaults are
  switched off. ``temperature <= 0`` means greedy (llama.cpp itself treats a
  *negative* temperature as plain sampling, so it is clamped to 0).
* **Seeds.** A request seed is folded into llama.cpp's 32-bit seed space,
  avoiding ``0xFFFFFFFF`` (llama.cpp's "pick a random seed"). Without a seed a
  fresh random one is drawn: llama-cpp-python's own ``seed=None`` derives the
  next seed deterministically from the previous one, so every process (and
  every context) would repeat the same "random" answers.
* **Token counts.** Each streamed chunk is one :class:`Piece` with
  ``tokens=1``; the final piece carries the difference to the number of tokens
  the model actually sampled (a chunk can hold several tokens, text held back
  for a possible stop string is never sent, and the end-of-generation token is
  counted, as vLLM counts it), so the pieces add up to the true usage.
* **Chat without a rendered prompt.** When preprocess did not render the
  prompt, the GGUF's own chat template (``tokenizer.chat_template``) renders
  the messages with a generation prompt; any continuation is appended after
  it.
* **Reproducible seeded answers.** A request with a ``seed`` evaluates its
  prompt afresh: a prefix reused from the context's previous request was
  computed in another batch shape, whose float rounding differs enough to
  change a sampled token, so the same seed gave different answers depending
  on what the context served before. Without a seed the prefix is reused:
  evaluating every prompt afresh cost 7 points of throughput against llama.cpp alone
  (docs/decisions/0009-same-answer-at-temperature-0.md). The tokens reused
  are the answer's ``cached_tokens``.
* **Host memory behind the contexts.** With ``host_cache_bytes``, the KV
  cache of a conversation a context moves on from is kept in host memory
  and copied back when its next turn comes (llamacpp_cache).
* **The context holding the prompt's prefix.** Of the free contexts, a
  request without a seed takes the one whose cache begins with the longest
  part of its prompt (the next turn of a conversation finds its history
  there), less what it would throw away of the prompt cached there: a new
  conversation takes an empty or long-unused context rather than one holding
  another conversation that shares only the template's first tokens with it.
  So prefix-aware routing (workers/prefix.py) pays off here too.
* **Tenants' prefixes apart.** A context remembers the salt of the prompt
  it holds (the request's ``cache_salt``, its tenant's): a prompt of another
  salt reuses none of it (nor is the context chosen for it), and the host
  cache restores only sequences of the prompt's own salt, so
  ``cached_tokens`` tells a tenant nothing of another's prompts.
* **Empty prompts** begin at the beginning-of-sequence token.
* **Structured outputs.** A request's response_format becomes llama.cpp's
  grammar sampler beside the chain llama-cpp-python builds
  (llamacpp_grammar.CheckedSampling): the chain draws, the grammar checks the
  draw and is applied to the whole vocabulary only when it refuses it, so
  only tokens the grammar allows are sampled, and the end of the answer only
  where the JSON is whole. A continued answer's tokens are accepted first.
* Every failure inside llama.cpp surfaces from :meth:`generate` as
  :class:`~conveyor.errors.EngineError`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
from llama_cpp import Llama, StoppingCriteriaList
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from conveyor.errors import EngineError, RequestError
from conveyor.registry import ModelSpec
from schemas.records import TokenLogprob
from workers.infer.engines.base import GenerationRequest, HostCacheStats, KvState, Piece
from workers.infer.engines.llamacpp_cache import (
    HostCache,
    held_tokens,
    kv_bytes_per_token,
    stats_of,
)
from workers.infer.engines.llamacpp_grammar import HeldSampler, constrained
from workers.infer.engines.llamacpp_prompts import (
    chat_formatter,
    common_prefix,
    prompt_or_bos,
    reuse_score,
)
from workers.infer.engines.llamacpp_sampling import checked_bias, llama_seed
from workers.infer.engines.logprobs import LoggedSampler, taken, with_logprobs

__all__ = ["LlamaCppEngine", "pieces_from"]

# llama.cpp seeds are uint32 and 0xFFFFFFFF (LLAMA_DEFAULT_SEED) means "random".

_Item = Piece | BaseException


@dataclass
class _Context:
    """One loaded model instance and the only thread that may touch it."""

    llm: Llama
    executor: ThreadPoolExecutor
    salt: str = ""  # the cache_salt of the prompts its cache holds


class _TokenWatch:
    """A llama.cpp stopping criterion: counts sampled tokens, stops on cancel.

    llama.cpp calls it once per sampled token with the sequence so far (the new
    token not yet in it), and once more after the loop with the same length as
    the last call, so the count is ``last length - first length + 1``.
    """

    def __init__(self, cancelled: threading.Event) -> None:
        self.cancelled = cancelled
        self.first = -1
        self.last = -1

    def __call__(self, input_ids: npt.NDArray[np.intc], logits: npt.NDArray[np.single]) -> bool:
        n = len(input_ids)
        if self.first < 0:
            self.first = n
        self.last = max(self.last, n)
        return self.cancelled.is_set()

    @property
    def sampled(self) -> int:
        return 0 if self.first < 0 else self.last - self.first + 1


class LlamaCppEngine:
    """Serves ``contexts`` generations at once from one GGUF file."""

    def __init__(
        self,
        model_path: Path,
        contexts: int = 2,
        n_ctx: int = 2048,
        n_threads: int = 1,
        name: str = "llamacpp",
        host_cache_bytes: int = 0,
    ) -> None:
        if contexts < 1:
            raise ValueError("contexts must be at least 1")
        self.name = name
        self.capacity = contexts
        self.constrains_output = True  # llama.cpp's grammar sampler (llamacpp_grammar)
        self.decodes_tools = True  # the same sampler, on the tools' grammar
        self.biases_logits = True  # llama-cpp-python's logit_bias
        self.reports_logprobs = True  # read off the logits where it samples (logprobs.py)
        # the pool's models, all of them loaded (base.Engine)
        self.served: list[str] | None = None
        self.loaded: list[str] | None = None
        self.model_path = Path(model_path)
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self._contexts: list[_Context] = []
        self._free: asyncio.Queue[_Context] | None = None
        self._chat_formatter: Jinja2ChatFormatter | None = None
        self._running: set[threading.Event] = set()
        # the KV caches of conversations their contexts moved on from (llamacpp_cache)
        self.host_cache = HostCache(host_cache_bytes) if host_cache_bytes > 0 else None
        self._token_bytes: int | None = None  # a token's KV, from the model's metadata

    @classmethod
    def from_spec(cls, spec: ModelSpec, contexts: int = 2, n_threads: int = 1,
                  host_cache_bytes: int = 0) -> LlamaCppEngine:
        """An engine for a registry model: its GGUF file and context length."""
        return cls(spec.gguf_path(), contexts=contexts, n_ctx=spec.context_length,
                   n_threads=n_threads, host_cache_bytes=host_cache_bytes)

    async def start(self) -> None:
        """Load every context in its own thread, one after another.

        Not concurrently: with ``verbose=False`` llama-cpp-python silences a
        load by swapping the process's stdout/stderr file descriptors, and two
        overlapping loads restore them in the wrong order, leaving the whole
        process writing to /dev/null.
        """
        if self._contexts:
            return
        loop = asyncio.get_running_loop()
        executors = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-ctx{i}")
            for i in range(self.capacity)
        ]
        llms: list[Llama] = []
        try:
            for executor in executors:
                llms.append(await loop.run_in_executor(executor, self._load))
        except Exception as exc:
            for llm in llms:
                llm.close()
            for executor in executors:
                executor.shutdown(wait=False)
            raise EngineError(f"cannot load {self.model_path}: {exc}") from exc
        self._contexts = [_Context(llm, ex) for llm, ex in zip(llms, executors, strict=True)]
        self._free = asyncio.Queue()
        for context in self._contexts:
            self._free.put_nowait(context)
        self._chat_formatter = chat_formatter(llms[0])
        self._token_bytes = kv_bytes_per_token(llms[0].metadata)

    def _load(self) -> Llama:
        return Llama(
            model_path=str(self.model_path),
            n_ctx=self.n_ctx,
            n_threads=self.n_threads,
            n_threads_batch=self.n_threads,
            verbose=False,
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        """Stream one answer from a free context (see the module notes)."""
        free = self._free
        if free is None:
            raise EngineError(f"engine {self.name} is not started")
        context = await free.get()
        try:
            if request.seed is None and not free.empty():
                context = self._nearest(context, free, self._prompt(request),
                                        request.cache_salt)
        except BaseException:
            free.put_nowait(context)
            raise
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        cancelled = threading.Event()
        self._running.add(cancelled)

        def emit(item: _Item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening
                cancelled.set()

        try:
            context.executor.submit(self._run, context, request, cancelled, emit)
            async for piece in pieces_from(queue):
                yield piece
        finally:
            cancelled.set()
            self._running.discard(cancelled)
            free.put_nowait(context)

    @staticmethod
    def _nearest(first: _Context, free: asyncio.Queue[_Context], prompt: str,
                 salt: str) -> _Context:
        """Of the free contexts (``first`` and those still in ``free``), the one
        whose cache serves ``prompt`` (of ``salt``) best; the others go back.
        The next turn of a conversation, or another prompt with the same system
        prompt, then costs only its new tokens; a cache of another salt serves
        it nothing."""
        tokens = list(first.llm.tokenize(prompt.encode("utf-8"), special=True)) if prompt else []
        contexts = [first]
        while not free.empty():
            contexts.append(free.get_nowait())
        # of equals, the one free longest (the queue's order): least recently used
        best = max(contexts, key=lambda c: reuse_score(
            c.llm.input_ids[:c.llm.n_tokens].tolist(), tokens) if c.salt == salt else 0)
        for context in contexts:
            if context is not best:
                free.put_nowait(context)
        return best

    def _run(
        self,
        context: _Context,
        request: GenerationRequest,
        cancelled: threading.Event,
        emit: Callable[[_Item], None],
    ) -> None:
        """The worker-thread side of one generation; never raises.

        It always ends with exactly one last item: the final piece or an
        exception (a cancellation too, which only matters when :meth:`close`
        cancelled a generation whose consumer is still waiting).
        """
        try:
            if cancelled.is_set():
                raise EngineError("the generation was cancelled")
            llm = context.llm
            watch = _TokenWatch(cancelled)
            prompt = prompt_or_bos(llm, self._prompt(request))
            tokens = (prompt if isinstance(prompt, list)
                      else llm.tokenize(prompt.encode("utf-8"), special=True))
            seeded = request.seed is not None
            salt, held_salt, context.salt = request.cache_salt, context.salt, request.cache_salt
            if self.host_cache is not None:
                # a seeded prompt saves what the context holds, and restores nothing;
                # a context of another salt is saved and emptied
                self.host_cache.before_prompt(llm, [] if seeded else tokens, restore=not seeded,
                                              salt=salt, held_salt=held_salt)
            elif held_salt != salt:
                llm.reset()  # nothing of another tenant's prompt
            if seeded:
                llm.reset()  # no prefix reuse: the same seeded request, the same answer
            # what llama-cpp-python reuses: the shared prefix, the prompt's last token
            # evaluated again when it is all there (it needs that token's logits)
            cached = max(0, min(common_prefix(llm.input_ids[:llm.n_tokens].tolist(), tokens),
                                len(tokens) - 1))
            constrained(llm, request)
            logprobs: list[TokenLogprob] = []
            with_logprobs(llm, request, logprobs)
            stream = cast(
                Iterator[dict[str, Any]],
                llm.create_completion(
                    prompt,
                    stream=True,
                    max_tokens=max(1, request.max_tokens),
                    temperature=max(0.0, request.temperature),
                    top_p=request.top_p,
                    top_k=0,
                    min_p=0.0,
                    seed=llama_seed(request.seed),
                    presence_penalty=request.presence_penalty,
                    frequency_penalty=request.frequency_penalty,
                    logit_bias=checked_bias(request, llm.n_vocab()),
                    stop=list(request.stop),
                    stopping_criteria=StoppingCriteriaList([watch]),
                ),
            )
            emitted = 0
            try:
                for chunk in stream:
                    if cancelled.is_set():
                        raise EngineError("the generation was cancelled")
                    choice = chunk["choices"][0]
                    text: str = choice["text"]
                    reason = choice["finish_reason"]
                    if reason is not None:
                        finish: Literal["stop", "length"] = (
                            "length" if reason == "length" else "stop"
                        )
                        emit(Piece(text, tokens=max(0, watch.sampled - emitted),
                                   finish_reason=finish, cached_tokens=cached,
                                   logprobs=taken(logprobs)))
                        return
                    if text:
                        emit(Piece(text, tokens=1, logprobs=taken(logprobs)))
                        emitted += 1
            finally:
                cast(Any, stream).close()
                # constrained()'s or with_logprobs()'s sampler, for this request only
                if vars(llm).pop("_init_sampler", None) is not None:
                    held = cast(Any, llm)._sampler
                    if isinstance(held, (HeldSampler, LoggedSampler)):
                        held.close()
                    cast(Any, llm)._sampler = None
            raise EngineError("llama.cpp ended the stream without a finish_reason")
        except Exception as exc:
            emit(exc)

    def _prompt(self, request: GenerationRequest) -> str:
        if request.prompt_text is not None or request.kind == "completion":
            return (request.prompt_text or "") + request.continuation
        if self._chat_formatter is None:
            raise EngineError(f"{self.model_path.name} has no chat template")
        messages = [{"role": m["role"], "content": m["content"]} for m in request.messages]
        rendered = self._chat_formatter(messages=cast(Any, messages))
        return rendered.prompt + request.continuation

    def kv_state(self) -> KvState | None:
        return None  # no KV cache the worker can see (see base.Engine)

    def host_cache_stats(self) -> HostCacheStats | None:
        return stats_of(self.host_cache)

    def cache_tokens(self) -> int | None:
        """The contexts' tokens, and its host cache's (base.HoldsPrompts)."""
        return held_tokens(self.capacity * self.n_ctx, self.host_cache, self._token_bytes)

    async def close(self) -> None:
        """Cancel what runs, wait for the threads, free the models."""
        for cancelled in list(self._running):
            cancelled.set()
        contexts, self._contexts, self._free = self._contexts, [], None
        for context in contexts:
            await asyncio.to_thread(context.executor.shutdown, True)
            context.llm.close()


async def pieces_from(queue: asyncio.Queue[_Item]) -> AsyncGenerator[Piece, None]:
    """The pieces an engine thread puts on ``queue`` up to the last one; an
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
