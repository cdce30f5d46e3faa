"""The llama.cpp engine's sampling: the seed, a request's logit_bias checked
against the vocabulary (llama.cpp's logit-bias sampler indexes logits by token
id: a token outside would write out of bounds), and a sequence's sampler
chain (logit bias, penalties, temperature, top_p, the draw; a structured
answer's grammar checks the draw).
"""

from __future__ import annotations

import secrets
from typing import Any, cast

import llama_cpp

from conveyor.errors import InvalidRequest
from workers.infer.engines.base import GenerationRequest
from workers.infer.engines.llamacpp_grammar import CheckedSampling, grammar_sampler

__all__ = ["llama_seed", "checked_bias", "bias_sampler", "sequence_sampler"]

_SEED_SPACE = 0xFFFFFFFF
# the sampled tokens the presence and frequency penalties look back over
_PENALTY_WINDOW = 64


def llama_seed(seed: int | None) -> int:
    """llama.cpp's 32-bit seed of a request's (any 64-bit) seed; random without one."""
    if seed is None:
        return secrets.randbelow(_SEED_SPACE)
    return seed % _SEED_SPACE


def checked_bias(request: GenerationRequest, n_vocab: int) -> dict[int, float] | None:
    """The request's logit_bias, each token checked against the vocabulary
    (preprocess checked it; an event may be forged); None without one."""
    if not request.logit_bias:
        return None
    for token, _ in request.logit_bias:
        if not 0 <= token < n_vocab:
            raise InvalidRequest(f"Invalid 'logit_bias': token {token} is not in the "
                                 "model's vocabulary.", param="logit_bias")
    return dict(request.logit_bias)


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
    """llama.cpp's logit-bias sampler of the request's logit_bias (checked)."""
    bias = checked_bias(request, n_vocab) or {}
    biases = (llama_cpp.llama_logit_bias * len(bias))()
    for i, (token, value) in enumerate(bias.items()):
        entry = cast(Any, biases[i])
        entry.token, entry.bias = token, value
    return llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(bias), biases)
