"""Decoding within a response_format on the llama.cpp engines: the format's
GBNF grammar (schemas/structured.py) as a llama.cpp grammar sampler, and the
walk of a continuation through it.

A retry continues an answer another run began (the worker's death, a
handover). The grammar must then stand where that answer stopped, so the
continuation's tokens are accepted into the sampler before the first new
token is sampled. llama.cpp aborts the process when a sampler accepts a token
its grammar forbids, so each token is first offered to a grammar of its own
(``llama_sampler_apply`` on that one token, which masks and never fails): a
continuation the grammar does not allow, written by an engine that held the
answer to nothing, is an :class:`EngineError`, not a crash.
"""

from __future__ import annotations

import ctypes
import math
from functools import lru_cache
from typing import Any, cast

import llama_cpp
from llama_cpp import LlamaGrammar

from conveyor.errors import EngineError
from schemas.records import ResponseFormat
from schemas.structured import grammar_of

__all__ = ["llama_grammar", "grammar_sampler", "checked_prefix"]

_ROOT = b"root"


def llama_grammar(fmt: ResponseFormat) -> LlamaGrammar:
    """llama-cpp-python's grammar object of a format (for ``create_completion``)."""
    return _grammar_object(grammar_of(fmt))


@lru_cache(maxsize=256)
def _grammar_object(text: str) -> LlamaGrammar:
    return LlamaGrammar.from_string(text, verbose=False)


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
