"""OpenAI requests turned into the pipeline's :class:`~schemas.records.Generation`.

One place for the conversion, used by the gateway for interactive requests
and by the jobs layer for each line of a batch, so a batch line runs exactly
as the same request sent alone would.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from conveyor.errors import InvalidRequest
from schemas.openai.requests import ChatCompletionRequest, ChatMessage, CompletionRequest
from schemas.records import Generation, ImageRef, Message, Sampling

__all__ = ["chat_generation", "completion_generation"]


def chat_generation(body: ChatCompletionRequest,
                    images: Mapping[tuple[int, int], ImageRef] | None = None) -> Generation:
    """``images``: the stored image parts, by (message index, content index)
    (gateway/images.py); an image part without one is refused, naming it (a
    batch's line: only POST /v1/chat/completions takes images)."""
    _one_choice(body)
    messages = [_message(m, i, images or {}) for i, m in enumerate(body.messages)]
    generation = _generation("chat", body, messages=messages, prompt=None,
                             max_tokens=body.token_budget())
    if body.response_format is not None:
        generation["response_format"] = body.response_format.record()
    generation["tools"] = body.tools_record()
    return generation


def _message(m: ChatMessage, index: int,
             images: Mapping[tuple[int, int], ImageRef]) -> Message:
    refs: list[ImageRef] = []
    for j, _, _ in m.image_parts():
        ref = images.get((index, j))
        if ref is None:
            where = f"messages[{index}].content[{j}]"
            raise InvalidRequest(f"Invalid '{where}': image parts are taken by POST "
                                 "/v1/chat/completions only.", param=where)
        refs.append(ref)
    return Message(role=m.role, content=m.text(), name=m.name,
                   tool_calls=[c.record() for c in m.tool_calls] if m.tool_calls else None,
                   tool_call_id=m.tool_call_id, images=refs or None)


def completion_generation(body: CompletionRequest) -> Generation:
    _one_choice(body)
    max_tokens = body.token_budget()
    return _generation("completion", body, messages=[], prompt=body.prompt_text(),
                       max_tokens=max_tokens)


def _one_choice(body: ChatCompletionRequest | CompletionRequest) -> None:
    """The generation is one choice's: the HTTP routes ask for each of several
    choices alone (gateway/chat/serving.py); batches and the WebSocket API
    serve one."""
    if body.choices() > 1:
        raise InvalidRequest("n > 1 is served by POST /v1/chat/completions and "
                             "/v1/completions; here only n=1 is supported.", param="n")


def _generation(kind: str, body: ChatCompletionRequest | CompletionRequest, *,
                messages: list[Message], prompt: str | None,
                max_tokens: int | None) -> Generation:
    presence, frequency = body.penalties()
    logprobs, top_logprobs = body.logprobs_asked()
    sampling = Sampling(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_tokens=max_tokens, stop=body.stop_list(), seed=body.seed,
        presence_penalty=presence, frequency_penalty=frequency, logit_bias=body.bias(),
        logprobs=logprobs, top_logprobs=top_logprobs,
    )
    return Generation(kind=kind, model=body.model, messages=messages,  # type: ignore[typeddict-item]
                      prompt=prompt, sampling=sampling, stream=bool(body.stream),
                      include_usage=body.include_usage(), created=int(time.time()),
                      store=bool(body.store), metadata=dict(body.metadata or {}),
                      api="chat.completions" if kind == "chat" else "completions",
                      response_format=None, tools=None, embedding=None)
