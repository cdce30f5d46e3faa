"""OpenAI's ``logprobs`` objects from the tokens' log probabilities the engines
report (schemas/records.TokenLogprob): chat's ``{"content": [...]}`` and the
legacy completions' parallel lists. Streamed chunks carry the tokens of their
text; the whole answer carries all of them."""

from __future__ import annotations

from typing import Any

from schemas.records import Generation, TokenLogprob

__all__ = ["asks_logprobs", "chat_logprobs", "completion_logprobs"]


def asks_logprobs(generation: Generation) -> bool:
    return bool(generation["sampling"].get("logprobs"))


def _entry(token: str, data: bytes, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(data)}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``logprobs``: each token with its ``top_logprobs``."""
    return {"content": [{**_entry(e["token"], e["bytes"], e["logprob"]),
                         "top_logprobs": [_entry(t["token"], t["bytes"], t["logprob"])
                                          for t in e["top"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy completions' ``logprobs``: tokens, their log probabilities, the
    alternatives at each place, and where each token begins in the completion
    (characters, counting from ``offset``, where these tokens begin)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"]} for e in entries],
            "text_offset": offsets}
