"""The engine-thread side of :mod:`workers.infer.engines.llamacpp_batch`: one
batched llama.cpp context, the only thread that touches it, its slots (a
sequence id each and the tokens its cache holds), the sequences it decodes,
their text (UTF-8 across tokens, stop strings held back), what a cached
sequence is worth to a prompt (:func:`reuse_score`), and each sequence's
sampler chain in OpenAI's order (logit bias checked against the vocabulary,
penalties, temperature, top_p, the draw; a structured answer's grammar checks
the draw). Log probabilities (:func:`logprob_of`) are the model's own
distribution, a log-softmax of the raw logits before sampling shapes it (as
vLLM reports them), computed only for requests that ask. The module notes of
``llamacpp_batch`` give the decisions.
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import os
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, cast

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from conveyor.errors import EngineError, InvalidRequest
from schemas.records import TokenLogprob, TopLogprob
from workers.infer.engines.base import GenerationRequest, Piece
from workers.infer.engines.llamacpp_cache import HostCache
from workers.infer.engines.llamacpp_grammar import CheckedSampling, grammar_sampler
from workers.stops import first_stop, held_tail

__all__ = ["Context", "Sequence", "Text", "chat_formatter", "common_prefix",
           "reuse_score", "llama_seed", "bias_sampler", "sequence_sampler",
           "logprob_of", "token_bytes", "taken"]


Item = Piece | BaseException


class Text:
    """One answer's text: token bytes in, text that is safe to send out."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._stop = [s for s in stop if s]
        self._held = ""

    def push(self, data: bytes) -> tuple[str, bool]:
        """The text that can go out now, and whether a stop string ended it."""
        held = self._held + self._decoder.decode(data)
        cut = first_stop(held, self._stop)
        if cut is not None:
            self._held = ""
            return held[:cut], True
        keep = held_tail(held, self._stop)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep], False

    def flush(self) -> str:
        """What was held back, at the end of an answer (an unfinished character dropped)."""
        held, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return held


@dataclass(eq=False)
class _Slot:
    """A sequence id of a context and the tokens its cache holds, by position."""

    seq_id: int
    cached: list[int] = field(default_factory=list)
    salt: str = ""  # the cache_salt of the prompts ``cached`` came from
    busy: bool = False
    freed: int = 0  # when it was last freed, in the context's count of frees


@dataclass(eq=False)
class Sequence:
    """One generation, from the asyncio side's hand-off to its last piece."""

    request: GenerationRequest
    prompt_tokens: list[int]
    emit: Callable[[Item], None]
    cancelled: bool = False
    # from here on, touched only on its context's thread
    slot: _Slot | None = None
    fed: int = 0  # prompt tokens in the cache
    reused: int = 0
    next_token: int = -1  # sampled, not yet decoded
    sampler: Any = None
    # a structured answer's continuation: its grammar sampler takes these first
    accepted: list[int] = field(default_factory=list)
    text: Text = field(init=False)
    sampled: int = 0
    emitted: int = 0
    # with logprobs asked for: the sampled tokens' not yet sent with a piece
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.text = Text(self.request.stop)


class Context:
    """One batched llama.cpp context, its share of the sequences, and the one
    thread that touches it."""

    def __init__(self, llm: Llama, executor: ThreadPoolExecutor, share: int, n_ctx: int,
                 n_threads: int, prefill_chunk: int, host: HostCache | None = None) -> None:
        self.llm = llm
        self.host = host
        self.executor = executor
        self.share = share
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.prefill_chunk = prefill_chunk
        self.assigned = 0  # routed here and not yet ended (event loop only)
        self.reused_tokens = 0  # prompt tokens taken from the cache instead of evaluated
        self.prompt_tokens = 0  # prompt tokens of every sequence so far (reused or not)
        self.loop_done: asyncio.Future[None] | None = None
        self._wake = threading.Condition()
        self._inbox: list[Sequence] = []
        self._stopping = False
        # thread state
        self._ctx: Any = None
        self._batch: Any = None
        self._vocab: Any = None
        self.slots: list[_Slot] = []
        self._active: list[Sequence] = []
        self._frees = 0  # slots freed so far: the order of their last use

    # -- the asyncio side ---------------------------------------------------------

    def run(self) -> None:
        self.loop_done = asyncio.wrap_future(self.executor.submit(self._run_loop))

    def submit(self, sequence: Sequence) -> None:
        with self._wake:
            if self._stopping:
                raise EngineError("the generation was cancelled: the engine closed")
            self._inbox.append(sequence)
            self._wake.notify()

    def stop(self) -> None:
        """Cancel what runs and end the loop after its step."""
        with self._wake:
            self._stopping = True
            for sequence in self._inbox + self._active:
                sequence.cancelled = True
            self._wake.notify()

    def reusable(self, tokens: list[int], salt: str) -> int:
        """The longest prefix of ``tokens`` a free slot of ``salt`` holds: read while
        the thread works, so a hint for routing (the thread picks the slot)."""
        held = max((common_prefix(s.cached, tokens) for s in self.slots
                    if not s.busy and s.salt == salt), default=0)
        return min(held, len(tokens) - 1)

    def cells(self) -> tuple[int, int]:
        """Cells that running sequences hold, and that free slots keep."""
        used = sum(len(slot.cached) for slot in self.slots if slot.busy)
        kept = sum(len(slot.cached) for slot in self.slots if not slot.busy)
        return used, kept

    # -- the thread: making and freeing -----------------------------------------------

    def load(self) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.n_ctx * self.share
        params.n_batch = params.n_ubatch = self.prefill_chunk + self.share
        params.n_seq_max = self.share
        params.n_threads = params.n_threads_batch = self.n_threads
        params.kv_unified = True  # one KV cache for all its sequences, each within n_ctx
        params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not self._ctx:
            raise EngineError("llama.cpp could not make a context")
        self._batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.slots = [_Slot(i) for i in range(self.share)]

    def free(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
        if self._ctx:
            llama_cpp.llama_free(self._ctx)
        self._batch = self._ctx = None

    # -- the thread: the loop ---------------------------------------------------------

    def _run_loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._inbox or self._active):
                    self._wake.wait()
                if self._stopping:
                    break
            for sequence in [s for s in self._active if s.cancelled]:
                self._leave(sequence, EngineError("the generation was cancelled"))
            with self._wake:
                free = self.share - len(self._active)
                joining, self._inbox = self._inbox[:free], self._inbox[free:]
            for sequence in joining:
                self._join(sequence)
            if self._active:
                try:
                    self._step()
                except Exception as exc:  # a failed step fails the sequences in it
                    for sequence in list(self._active):
                        self._forget(sequence)
                        self._leave(sequence, exc)
        with self._wake:
            left, self._inbox = self._inbox + self._active, []
        closed = "the generation was cancelled: the engine closed"
        for sequence in left:
            if sequence.slot is not None:
                self._leave(sequence, EngineError(closed))
            else:
                sequence.emit(EngineError(closed))

    def _join(self, sequence: Sequence) -> None:
        if sequence.cancelled:
            return
        request, tokens = sequence.request, sequence.prompt_tokens
        salt = request.cache_salt
        try:
            reuse = request.seed is None
            # the best reuse (none from a slot of another salt); of equals, the least
            # recently used
            slot = max((s for s in self.slots if not s.busy),
                       key=lambda s: (reuse_score(s.cached, tokens) if s.salt == salt else 0,
                                      -s.freed) if reuse
                       else (-len(s.cached), -s.freed))
            kept = (min(common_prefix(slot.cached, tokens), len(tokens) - 1)
                    if reuse and slot.salt == salt else 0)
            if self.host is not None:
                kept = self._through_host(self.host, slot, tokens, kept, reuse, salt)
            slot.salt = salt
            memory = llama_cpp.llama_get_memory(self._ctx)
            if not llama_cpp.llama_memory_seq_rm(memory, slot.seq_id, kept, -1):
                kept = 0
                llama_cpp.llama_memory_seq_rm(memory, slot.seq_id, -1, -1)
            del slot.cached[kept:]
            sequence.sampler = sequence_sampler(request, self._vocab, sequence.accepted)
        except Exception as exc:
            sequence.emit(exc)
            return
        slot.busy = True
        sequence.slot = slot
        sequence.fed = sequence.reused = kept
        self.reused_tokens += kept
        self.prompt_tokens += len(tokens)
        self._active.append(sequence)

    def _through_host(self, host: HostCache, slot: _Slot, tokens: list[int], kept: int,
                      reuse: bool, salt: str) -> int:
        """The slot's cache saved to host memory (under its own salt) if the prompt
        throws it away, and a saved sequence of the prompt's ``salt`` that serves
        it better put in its place (llamacpp_cache): what the slot keeps for the
        prompt then."""
        entry = host.take(tokens, kept + host.min_tokens, salt) if reuse else None
        if len(slot.cached) - kept >= host.min_tokens:
            host.save(self._ctx, slot.seq_id, slot.cached, slot.salt)
        if entry is None:
            return kept
        if not host.restore(self._ctx, slot.seq_id, entry):
            slot.cached.clear()
            return 0
        slot.cached[:] = entry.tokens
        return min(common_prefix(slot.cached, tokens), len(tokens) - 1)

    def _step(self) -> None:
        """One ``llama_decode`` for every running sequence, then one token each."""
        batch, outputs = self._batch, []
        n = 0

        def put(sequence: Sequence, token: int, logits: bool) -> None:
            nonlocal n
            slot = cast(_Slot, sequence.slot)
            batch.token[n], batch.pos[n] = token, len(slot.cached)
            batch.n_seq_id[n], batch.seq_id[n][0] = 1, slot.seq_id
            batch.logits[n] = logits
            slot.cached.append(token)
            if logits:
                outputs.append((sequence, n))
            n += 1

        prefilling = []
        for sequence in self._active:
            if sequence.fed < len(sequence.prompt_tokens):
                prefilling.append(sequence)
            else:
                put(sequence, sequence.next_token, True)
        budget = self.prefill_chunk
        for sequence in prefilling:
            take = min(budget, len(sequence.prompt_tokens) - sequence.fed)
            for i in range(sequence.fed, sequence.fed + take):
                put(sequence, sequence.prompt_tokens[i], i == len(sequence.prompt_tokens) - 1)
            sequence.fed += take
            budget -= take
            if budget == 0:
                break
        batch.n_tokens = n
        code = llama_cpp.llama_decode(self._ctx, batch)
        if code == 1:  # no room in the cache: give up what free slots keep, try once more
            self._drop_free_caches()
            code = llama_cpp.llama_decode(self._ctx, batch)
        if code != 0:
            raise EngineError(f"llama_decode failed with code {code}")
        for sequence, index in outputs:
            sampler = sequence.sampler
            token = (sampler.sample(self._ctx, index) if isinstance(sampler, CheckedSampling)
                     else llama_cpp.llama_sampler_sample(sampler, self._ctx, index))
            request = sequence.request
            if request.logprobs and not llama_cpp.llama_vocab_is_eog(self._vocab, token):
                sequence.logprobs.append(logprob_of(self._ctx, index, self._n_vocab, token,
                                                    request.top_logprobs,
                                                    partial(token_bytes, self._vocab)))
            self._took(sequence, token)

    def _took(self, sequence: Sequence, token: int) -> None:
        """Stream what one sampled token adds, or end the answer."""
        sequence.sampled += 1
        if llama_cpp.llama_vocab_is_eog(self._vocab, token):
            self._finish(sequence, sequence.text.flush(), "stop")
            return
        text, stopped = sequence.text.push(token_bytes(self._vocab, token))
        if stopped:
            self._finish(sequence, text, "stop")
        elif (sequence.sampled >= max(1, sequence.request.max_tokens)
              or len(cast(_Slot, sequence.slot).cached) >= self.n_ctx):
            self._finish(sequence, text + sequence.text.flush(), "length")
        else:
            if text:
                sequence.emit(Piece(text, tokens=1, logprobs=taken(sequence.logprobs)))
                sequence.emitted += 1
            sequence.next_token = token

    def _finish(self, sequence: Sequence, text: str, reason: Literal["stop", "length"]) -> None:
        self._leave(sequence, Piece(text, tokens=max(0, sequence.sampled - sequence.emitted),
                                    finish_reason=reason,
                                    prompt_tokens=len(sequence.prompt_tokens),
                                    cached_tokens=sequence.reused,
                                    logprobs=taken(sequence.logprobs)))

    def _leave(self, sequence: Sequence, last: Item) -> None:
        """The sequence's last item out; its slot free, its cache kept for reuse."""
        if isinstance(sequence.sampler, CheckedSampling):
            sequence.sampler.free()
        elif sequence.sampler is not None:
            llama_cpp.llama_sampler_free(sequence.sampler)
        sequence.sampler = None
        if sequence.slot is not None:
            sequence.slot.busy = False
            self._frees += 1
            sequence.slot.freed = self._frees
        if sequence in self._active:
            self._active.remove(sequence)
        sequence.emit(last)

    def _forget(self, sequence: Sequence) -> None:
        """Empty the sequence's slot: after a failed decode its cache is unknown."""
        if sequence.slot is not None:
            memory = llama_cpp.llama_get_memory(self._ctx)
            llama_cpp.llama_memory_seq_rm(memory, sequence.slot.seq_id, -1, -1)
            sequence.slot.cached.clear()

    def _drop_free_caches(self) -> None:
        memory = llama_cpp.llama_get_memory(self._ctx)
        for slot in self.slots:
            if not slot.busy and slot.cached:
                llama_cpp.llama_memory_seq_rm(memory, slot.seq_id, -1, -1)
                slot.cached.clear()


def common_prefix(cached: list[int], tokens: list[int]) -> int:
    """How many leading ``tokens`` a cache holding ``cached`` holds already."""
    return len(os.path.commonprefix([cached, tokens]))


def reuse_score(cached: list[int], tokens: list[int]) -> int:
    """What a prompt of ``tokens`` gains from a cache holding ``cached``: the
    tokens it reuses less those of the cached sequence it throws away, 0 when
    that is nothing (the caller then takes the least recently used cache), and
    all of it when the cache holds the whole prompt (all but its last token),
    however long the answer after it (docs/decisions/0028-one-llama-cpp-engine.md)."""
    shared = common_prefix(cached, tokens)
    if shared and shared >= len(tokens) - 1:
        return shared
    return max(0, shared - (len(cached) - shared))


def chat_formatter(llm: Llama) -> Jinja2ChatFormatter | None:
    """The GGUF's own chat template, or None when the file has none."""
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return None

    def token_text(token: int) -> str:
        if token < 0:
            return ""
        return llm.detokenize([token], special=True).decode("utf-8", errors="ignore")

    return Jinja2ChatFormatter(
        template=template,
        eos_token=token_text(llm.token_eos()),
        bos_token=token_text(llm.token_bos()),
        add_generation_prompt=True,
    )


_SEED_SPACE = 0xFFFFFFFF
# the sampled tokens the presence and frequency penalties look back over
_PENALTY_WINDOW = 64


def llama_seed(seed: int | None) -> int:
    """llama.cpp's 32-bit seed of a request's (any 64-bit) seed; random without one."""
    if seed is None:
        return secrets.randbelow(_SEED_SPACE)
    return seed % _SEED_SPACE


def sequence_sampler(request: GenerationRequest, vocab: Any, accepted: list[int]) -> Any:
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    bias = bias_sampler(request, n_vocab) if request.logit_bias else None  # raises first
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    if bias is not None:
        llama_cpp.llama_sampler_chain_add(chain, bias)
    if request.presence_penalty or request.frequency_penalty:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_penalties(
            n_vocab, _PENALTY_WINDOW, 1.0, request.frequency_penalty,
            request.presence_penalty))
    if request.temperature <= 0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
    else:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(
            request.temperature))
        if request.top_p < 1.0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(
                request.top_p, 1))
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(
            llama_seed(request.seed)))
    if request.response_format is not None:  # the grammar checks the chain's draw
        checked = CheckedSampling(chain, grammar_sampler(vocab, request.response_format),
                                  n_vocab)
        for token in accepted:
            checked.accept(token)
        return checked
    for token in accepted:
        llama_cpp.llama_sampler_accept(chain, token)
    return chain


def bias_sampler(request: GenerationRequest, n_vocab: int) -> Any:
    """llama.cpp's logit-bias sampler of the request's logit_bias, each token
    checked against the vocabulary (preprocess checked it; an event may be forged)."""
    for token, _ in request.logit_bias:
        if not 0 <= token < n_vocab:
            raise InvalidRequest(f"Invalid 'logit_bias': token {token} is not in the "
                                 "model's vocabulary.", param="logit_bias")
    bias = dict(request.logit_bias)
    biases = (llama_cpp.llama_logit_bias * len(bias))()
    for i, (token, value) in enumerate(bias.items()):
        entry = cast(Any, biases[i])
        entry.token, entry.bias = token, value
    return llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), biases)


def token_bytes(vocab: Any, token: int) -> bytes:
    """A token's text as llama.cpp writes it (special tokens as nothing)."""
    buffer = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buffer, 64, 0, False)
    if n < 0:
        buffer = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buffer, -n, 0, False)
    return buffer.raw[:max(0, n)]


def logprob_of(ctx: Any, index: int, n_vocab: int, token: int, top: int,
               piece: Callable[[int], bytes]) -> TokenLogprob:
    """The log probability of ``token`` at output ``index`` of ``ctx``, and the
    ``top`` most likely tokens there."""
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index),
                                   shape=(n_vocab,)).astype(np.float64)
    peak = float(logits.max())
    total = peak + float(np.log(np.exp(logits - peak).sum()))
    best: list[TopLogprob] = []
    if top > 0:
        ids = np.argpartition(-logits, top)[:top]
        for i in sorted(ids.tolist(), key=lambda i: -logits[i]):
            data = piece(i)
            best.append(TopLogprob(token=data.decode("utf-8", "replace"), bytes=data,
                                   logprob=float(logits[i]) - total))
    data = piece(token)
    return TokenLogprob(token=data.decode("utf-8", "replace"), bytes=data,
                        logprob=float(logits[token]) - total, top=best)


def taken(pending: list[TokenLogprob]) -> tuple[TokenLogprob, ...]:
    """The log probabilities sampled since the last piece, for this one (emptied)."""
    out = tuple(pending)
    pending.clear()
    return out
