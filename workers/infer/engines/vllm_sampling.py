"""A request's sampling as vLLM's ``SamplingParams``, and the log
probabilities vLLM reports for each delta as Conveyor's (schemas/records
TokenLogprob), for the in-process vLLM engine (vllm.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from schemas.records import TokenLogprob, TopLogprob
from workers.infer.engines.base import GenerationRequest
from workers.infer.engines.vllm_structured import structured_outputs

if TYPE_CHECKING:
    from vllm import SamplingParams

__all__ = ["sampling_params", "delta_logprobs"]


def sampling_params(request: GenerationRequest) -> SamplingParams:
    """vLLM's ``SamplingParams`` of a request (OpenAI's and vLLM's mean the same)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=max(0.0, request.temperature),
        top_p=request.top_p if 0 < request.top_p <= 1 else 1.0,
        seed=request.seed,
        stop=list(request.stop) or None,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=dict(request.logit_bias) or None,
        logprobs=request.top_logprobs if request.logprobs else None,
        max_tokens=max(1, request.max_tokens),
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=structured_outputs(request),  # vllm_structured
    )


def delta_logprobs(completion: Any, top: int) -> list[TokenLogprob]:
    """vLLM's log probabilities of the tokens a delta output added: the sampled
    token's, and the ``top`` most likely by rank."""
    out: list[TokenLogprob] = []
    for token, entries in zip(completion.token_ids, completion.logprobs or (), strict=False):
        chosen = entries[token]
        ranked = sorted(((t, e) for t, e in entries.items()
                         if e.rank is not None and e.rank <= top), key=lambda te: te[1].rank)
        best = [TopLogprob(token=e.decoded_token or "", bytes=(e.decoded_token or "").encode(),
                           logprob=float(e.logprob)) for _, e in ranked]
        text = chosen.decoded_token or ""
        out.append(TokenLogprob(token=text, bytes=text.encode(), logprob=float(chosen.logprob),
                                top=best))
    return out
