"""Decoding within a response_format on the llama.cpp engine: the format's GBNF
grammar (schemas/structured.py) as a llama.cpp grammar sampler, and the walk
of a continuation through it.

A retried answer's continuation is accepted into the sampler before the first
new token. llama.cpp aborts the process when a sampler accepts a token its
grammar forbids, so each token is first offered to a grammar of its own
(``llama_sampler_apply`` masks, never fails): a continuation the grammar does
not allow is an :class:`EngineError`, not a crash. :class:`CheckedSampling`
applies the grammar to the whole vocabulary only when it refuses the chain's
draw, as llama.cpp's server does.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, cast

import llama_cpp

from conveyor.errors import EngineError
from schemas.answer_format import grammar_of
from schemas.records import ResponseFormat

__all__ = ["grammar_sampler", "checked_prefix", "CheckedSampling"]

_ROOT = b"root"


def grammar_sampler(vocab: Any, fmt: ResponseFormat) -> Any:
    """A llama.cpp grammar sampler of the format (a chain's member, or alone)."""
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar_of(fmt).encode(), _ROOT)
    if not sampler:
        raise EngineError("llama.cpp could not parse the grammar of the response_format")
    return sampler


def checked_prefix(vocab: Any, fmt: ResponseFormat, tokens: list[int]) -> None:
    """Raise EngineError unless the format's grammar allows ``tokens`` as the
    beginning of an answer (each one offered alone, then accepted)."""
    sampler = grammar_sampler(vocab, fmt)
    data = (llama_cpp.llama_token_data * 1)()
    candidates = llama_cpp.llama_token_data_array(data=data, size=1, selected=-1,
                                                  sorted=False)
    try:
        for i, token in enumerate(tokens):
            entry = cast(Any, data[0])
            entry.id, entry.logit, entry.p = token, 0.0, 0.0
            candidates.size, candidates.selected = 1, -1
            llama_cpp.llama_sampler_apply(sampler, ctypes.byref(candidates))
            if math.isinf(entry.logit):
                raise EngineError(f"the answer to continue leaves its response_format at "
                                  f"token {i} of {len(tokens)}: it cannot be continued")
            llama_cpp.llama_sampler_accept(sampler, token)
    finally:
        llama_cpp.llama_sampler_free(sampler)


class CheckedSampling:
    """Sampling held to a grammar as llama.cpp's server does it: the chain
    (penalties, temperature, top_p, the draw) picks a token with no grammar;
    only when the grammar refuses that token is it applied to the whole
    vocabulary and the chain run again (applying it every step cost about a
    fifth of the decode rate: docs/benchmarks/results/structured.md).
    ``chain`` (holding no grammar) and ``grammar`` are llama.cpp sampler
    pointers, both freed by :meth:`free`."""

    def __init__(self, chain: Any, grammar: Any, n_vocab: int) -> None:
        import numpy as np

        self.chain, self.grammar, self.n_vocab = chain, grammar, n_vocab
        self._all = (llama_cpp.llama_token_data * n_vocab)()
        self._view = np.frombuffer(memoryview(self._all), dtype=np.dtype(
            [("id", np.int32), ("logit", np.float32), ("p", np.float32)]))
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._view["id"] = self._ids
        self._candidates = llama_cpp.llama_token_data_array(
            data=self._all, size=n_vocab, selected=-1, sorted=False)
        self._one = (llama_cpp.llama_token_data * 1)()
        self._single = llama_cpp.llama_token_data_array(data=self._one, size=1, selected=-1,
                                                        sorted=False)

    def accept(self, token: int) -> None:
        """A token of the answer so far (a continuation's): both samplers take it."""
        llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain, token)

    def sample(self, ctx: Any, index: int) -> int:
        """The next token from the logits of output ``index``, accepted."""
        token = self._draw(ctx, index, with_grammar=False)
        if not self._allowed(token):
            token = self._draw(ctx, index, with_grammar=True)
        self.accept(token)
        return token

    def _draw(self, ctx: Any, index: int, with_grammar: bool) -> int:
        import numpy as np

        logits = llama_cpp.llama_get_logits_ith(ctx, index)
        self._view["logit"] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        self._view["p"] = 0.0
        self._view["id"] = self._ids  # a sampler may have sorted them
        self._candidates.size, self._candidates.selected = self.n_vocab, -1
        self._candidates.sorted = False
        if with_grammar:
            llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(self._candidates))
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(self._candidates))
        selected = int(self._candidates.selected)
        if not 0 <= selected < int(self._candidates.size):
            raise EngineError("the sampler chain selected no token")
        return int(cast(Any, self._all[selected]).id)

    def _allowed(self, token: int) -> bool:
        entry = cast(Any, self._one[0])
        entry.id, entry.logit, entry.p = token, 1.0, 0.0
        self._single.size, self._single.selected = 1, -1
        llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(self._single))
        return not math.isinf(entry.logit)

    def free(self) -> None:
        if self.grammar is not None:
            llama_cpp.llama_sampler_free(self.grammar)
        if self.chain is not None:
            llama_cpp.llama_sampler_free(self.chain)
        self.grammar = self.chain = None
