"""Log probabilities read off a llama.cpp context's logits where a token is
sampled, for OpenAI's ``logprobs``: the sampled token's, and the most likely
tokens' at its place (``top_logprobs``). They are the model's own
distribution (a log-softmax of the raw logits), before temperature, top_p,
penalties or a grammar shape the draw, as vLLM reports them by default.

A log-softmax over the whole vocabulary's logits at every sampled token is
done only for requests that ask.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import llama_cpp
import numpy as np

from schemas.records import TokenLogprob, TopLogprob

__all__ = ["logprob_of", "token_bytes", "LoggedSampler", "with_logprobs", "taken"]


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


class LoggedSampler:
    """The sampler llama-cpp-python asks for, wrapped: each token it samples
    (but the end of the answer) has its log probability put in ``sink``."""

    def __init__(self, inner: Any, vocab: Any, n_vocab: int, top: int,
                 sink: list[TokenLogprob]) -> None:
        self.inner, self.vocab, self.n_vocab, self.top, self.sink = inner, vocab, n_vocab, \
            top, sink

    def sample(self, ctx: Any, idx: int = -1) -> int:
        token = int(self.inner.sample(ctx, idx))
        if not llama_cpp.llama_vocab_is_eog(self.vocab, token):
            self.sink.append(logprob_of(ctx.ctx, idx, self.n_vocab, token, self.top,
                                        lambda t: token_bytes(self.vocab, t)))
        return token

    def close(self) -> None:
        self.inner.close()


def with_logprobs(llm: Any, request: Any, sink: list[TokenLogprob]) -> None:
    """Have ``llm`` (a llama-cpp-python ``Llama``) report the log probability of
    every token it samples for ``request`` into ``sink``, if the request asks:
    the sampler it builds (its own, or a structured one) is wrapped in a
    :class:`LoggedSampler`."""
    if not request.logprobs:
        return
    build = llm._init_sampler
    vocab = llm._model.vocab

    def init_sampler(**kwargs: Any) -> Any:
        return LoggedSampler(build(**kwargs), vocab, llm.n_vocab(), request.top_logprobs, sink)

    llm._init_sampler = init_sampler


def taken(pending: list[TokenLogprob]) -> tuple[TokenLogprob, ...]:
    """The log probabilities sampled since the last piece, for this one (emptied)."""
    out = tuple(pending)
    pending.clear()
    return out
