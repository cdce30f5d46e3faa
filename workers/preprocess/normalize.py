"""Validation, normalisation and length fitting of a generation request, as
pure functions: :func:`normalize_generation` checks a request (an
:class:`InvalidRequest` names the field in ``param``, like OpenAI's
``messages[2].role``) and returns a copy in Unicode NFC without NULs;
:func:`trim_to_context` (chat) or :func:`fit_prompt` (completion) measures the
prompt and fixes the completion budget, a conversation too long losing its
oldest turns; :func:`fingerprint` names the exact prompt for caches.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from functools import partial
from typing import NamedTuple, cast

from conveyor.errors import ContextLengthExceeded, InvalidRequest
from schemas.images import mapped_pieces
from schemas.records import Generation, ImageRef, Message, ToolCall
from workers.preprocess.images import images_tokens
from workers.preprocess.tokenizers import Tokenizer

__all__ = ["ROLES", "check_logit_bias", "Fit", "fingerprint", "fit_prompt", "measure_messages",
           "normalize_generation", "normalize_text", "trim_to_context"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Never dropped by trimming.
_PINNED_ROLES = frozenset({"system", "developer"})
# A kept conversation does not open with these (after the system prompt):
# an answer without its question confuses models, and strict templates refuse it.
_NO_OPENING_ROLES = frozenset({"assistant", "tool"})

# Without a local template: OpenAI's rule of thumb for ChatML-like formats.
_TOKENS_PER_MESSAGE = 4
_TOKENS_PER_REPLY = 3


class Fit(NamedTuple):
    """A prompt measured and fitted to the model's context window."""

    text: str | None  # the rendered prompt; None without a local template
    tokens: int
    max_tokens: int  # the completion budget
    dropped: int  # messages trimmed from the head of the conversation
    messages: list[Message]  # the messages kept (empty for a completion)


def normalize_text(text: str, param: str) -> str:
    """NFC, without NUL characters. A string that is not valid text (a lone
    UTF-16 surrogate, which no UTF-8 byte sequence can carry) is rejected."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"Invalid '{param}': the string is not valid Unicode text "
                             f"(character {exc.start} is an unpaired surrogate).",
                             param=param) from exc
    return unicodedata.normalize("NFC", text.replace("\x00", ""))


def _normalize_message(message: object, index: int) -> Message:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequest(f"Invalid '{where}': expected an object.", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"Invalid value for '{where}.role': {role!r}. Supported values "
                             f"are: {', '.join(repr(r) for r in sorted(ROLES))}.",
                             param=f"{where}.role")
    content = message.get("content")
    if not isinstance(content, str):
        raise InvalidRequest(f"Invalid type for '{where}.content': expected a string, "
                             f"got {type(content).__name__}.", param=f"{where}.content")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest(f"Invalid type for '{where}.name': expected a string.",
                             param=f"{where}.name")
    out = Message(role=role, content=normalize_text(content, f"{where}.content"),
                  name=normalize_text(name, f"{where}.name") if name is not None else None,
                  tool_calls=None, tool_call_id=None, images=None)
    images = message.get("images")
    if images:
        out["content"], out["images"] = _normalize_with_images(content, images, where)
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or role != "assistant":
            raise InvalidRequest(f"Invalid '{where}.tool_calls': only an assistant message "
                                 "holds a list of tool calls.", param=f"{where}.tool_calls")
        out["tool_calls"] = [_normalize_call(call, f"{where}.tool_calls[{i}]")
                             for i, call in enumerate(calls)]
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise InvalidRequest(f"Invalid type for '{where}.tool_call_id': expected a string.",
                                 param=f"{where}.tool_call_id")
        out["tool_call_id"] = normalize_text(call_id, f"{where}.tool_call_id")
    return out


def _normalize_with_images(content: str, images: object, where: str
                           ) -> tuple[str, list[ImageRef]]:
    """The text between the images normalised piece by piece (an image stays
    between the same characters), and the images with their offsets in it."""
    if not isinstance(images, list) or not all(
            isinstance(r, dict) and isinstance(r.get("sha256"), str) for r in images):
        raise InvalidRequest(f"Invalid '{where}.content': malformed image references.",
                             param=f"{where}.content")
    return mapped_pieces(content, cast(list[ImageRef], images),
                         partial(normalize_text, param=f"{where}.content"))


def _normalize_call(call: object, where: str) -> ToolCall:
    if not isinstance(call, dict) or not all(
            isinstance(call.get(k), str) for k in ("id", "name", "arguments")):
        raise InvalidRequest(f"Invalid '{where}': expected an id, a name and arguments.",
                             param=where)
    return ToolCall(id=normalize_text(call["id"], f"{where}.id"),
                    name=normalize_text(call["name"], f"{where}.function.name"),
                    arguments=normalize_text(call["arguments"], f"{where}.function.arguments"))


def normalize_generation(generation: Generation) -> Generation:
    """Validate ``generation`` and return a normalised copy (the input is not changed)."""
    max_tokens = generation["sampling"].get("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest("Invalid 'max_tokens': integer below minimum value. Expected a "
                             f"value >= 1, but got {max_tokens} instead.", param="max_tokens")
    if generation["kind"] == "chat":
        messages = generation.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("Invalid 'messages': a chat completion needs at least one "
                                 "message.", param="messages")
        return {**generation,
                "messages": [_normalize_message(m, i) for i, m in enumerate(messages)]}
    prompt = generation.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("Invalid 'prompt': a completion needs a prompt string.",
                             param="prompt")
    return {**generation, "prompt": normalize_text(prompt, "prompt")}


def check_logit_bias(generation: Generation, vocab_size: int | None) -> None:
    """Every token ``logit_bias`` names is in the model's vocabulary (where it is
    known here; an upstream checks its own)."""
    bias = generation["sampling"].get("logit_bias") or {}
    if vocab_size is None:
        return
    for token in bias:
        if int(token) >= vocab_size:
            raise InvalidRequest(
                f"Invalid 'logit_bias': token {token} is not in the vocabulary of "
                f"{generation['model']} (token ids are 0 to {vocab_size - 1}).",
                param="logit_bias")


def _rendered(messages: list[Message], tokenizer: Tokenizer) -> str | None:
    """The prompt the model's template renders; None without a local template,
    or with images (which a text template leaves out: the engine renders them)."""
    if any(m.get("images") for m in messages):
        return None
    return tokenizer.render_chat(messages)


def measure_messages(messages: list[Message], tokenizer: Tokenizer) -> tuple[str | None, int]:
    """The rendered prompt (or None) and its token count. Without a local
    template the count is the contents plus a few tokens of framing each, and
    each image's tokens (conveyor/images.py)."""
    text = _rendered(messages, tokenizer)
    if text is not None:
        return text, tokenizer.count(text)
    return None, _TOKENS_PER_REPLY + sum(
        _TOKENS_PER_MESSAGE + tokenizer.count(m["content"]) + images_tokens(m)
        for m in messages)


def _fits(tokens: int, requested: int | None, context_length: int) -> bool:
    return tokens + (requested if requested is not None else 1) <= context_length


def _budget(tokens: int, requested: int | None, default: int, context_length: int) -> int:
    if requested is not None:
        return requested
    return min(default, context_length - tokens)


def _drop_plans(messages: list[Message]) -> tuple[list[int], list[int]]:
    """The ways to trim, shortest first: the droppable messages (oldest first;
    not system or developer, not the last one) and the counts ``k`` worth
    trying, plan ``k`` dropping the ``k`` oldest of them. A count after which
    the conversation would open with an assistant or tool turn is skipped:
    that turn goes together with the one before it."""
    last = len(messages) - 1
    droppable = [i for i, m in enumerate(messages)
                 if i != last and m["role"] not in _PINNED_ROLES]
    counts: list[int] = []
    for k in range(1, len(droppable) + 1):
        # The first kept turn after the system prompt.
        opening = droppable[k] if k < len(droppable) else last
        if opening != last and messages[opening]["role"] in _NO_OPENING_ROLES:
            continue
        counts.append(k)
    return droppable, counts


def trim_to_context(messages: list[Message], tokenizer: Tokenizer, context_length: int,
                    max_tokens_requested: int | None, default_max_tokens: int) -> Fit:
    """Render and measure a conversation, dropping the fewest oldest turns (never
    a system or developer message, nor the last) for the prompt and the budget
    (``max_tokens_requested``, else ``min(default_max_tokens, room left)``, at
    least one) to fit ``context_length``, in O(log n) renders;
    :class:`ContextLengthExceeded` when none does."""
    rendered = _rendered(messages, tokenizer)
    if rendered is not None and not _fits(
            tokenizer.min_count(rendered), max_tokens_requested, context_length):
        tokens = -1  # known too long without counting it: counted only for an error
    else:
        text, tokens = measure_messages(messages, tokenizer)
        if _fits(tokens, max_tokens_requested, context_length):
            budget = _budget(tokens, max_tokens_requested, default_max_tokens, context_length)
            return Fit(text, tokens, budget, 0, list(messages))

    droppable, counts = _drop_plans(messages)

    def attempt(plan: int) -> Fit | None:
        dropped = set(droppable[: counts[plan]])
        kept = [m for i, m in enumerate(messages) if i not in dropped]
        kept_text, kept_tokens = measure_messages(kept, tokenizer)
        if not _fits(kept_tokens, max_tokens_requested, context_length):
            return None
        budget = _budget(kept_tokens, max_tokens_requested, default_max_tokens, context_length)
        return Fit(kept_text, kept_tokens, budget, len(dropped), kept)

    # Search from the short end (the most drops) with a doubling step, then
    # bisect: no render holds much more than twice the messages of the
    # answer, so a huge history costs little beyond its first measurement.
    fits, misses = len(counts) - 1, -1  # plan -1: nothing dropped, known not to fit
    best = attempt(fits) if counts else None
    if best is None:
        if tokens < 0:
            tokens = measure_messages(messages, tokenizer)[1]
        raise _context_error(context_length, tokens, max_tokens_requested, "messages")
    step = 1
    while fits - step > misses:
        found = attempt(fits - step)
        if found is None:
            misses = fits - step
            break
        fits, best, step = fits - step, found, step * 2
    while fits - misses > 1:
        middle = (fits + misses) // 2
        found = attempt(middle)
        if found is None:
            misses = middle
        else:
            fits, best = middle, found
    return best


def fit_prompt(prompt: str, tokenizer: Tokenizer, context_length: int,
               max_tokens_requested: int | None, default_max_tokens: int) -> Fit:
    """Measure a raw completion prompt. A raw prompt has no turns to drop:
    one that does not fit is rejected."""
    tokens = tokenizer.count(prompt)
    if not _fits(tokens, max_tokens_requested, context_length):
        raise _context_error(context_length, tokens, max_tokens_requested, "prompt")
    budget = _budget(tokens, max_tokens_requested, default_max_tokens, context_length)
    return Fit(prompt if tokenizer.exact else None, tokens, budget, 0, [])


def _context_error(context_length: int, tokens: int, requested: int | None,
                   param: str) -> ContextLengthExceeded:
    """OpenAI's wording for each case."""
    prompt = param == "prompt"
    if requested is None:
        detail = f"However, your {'prompt' if prompt else 'messages'} resulted in {tokens} tokens."
    elif prompt:
        detail = (f"However, you requested {tokens + requested} tokens ({tokens} in your "
                  f"prompt; {requested} for the completion).")
    else:
        detail = (f"However, you requested {tokens + requested} tokens ({tokens} in the "
                  f"messages, {requested} in the completion).")
    advice = ("Please reduce your prompt; or completion length." if prompt
              else "Please reduce the length of the messages or completion.")
    return ContextLengthExceeded(f"This model's maximum context length is {context_length} "
                                 f"tokens. {detail} {advice}", param=param)


def fingerprint(model: str, text: str | None, messages: list[Message], prompt: str | None) -> str:
    """sha256 (hex, first 32 characters) of the model name and the exact
    prompt: the rendered text, else the raw prompt, else the messages as
    canonical JSON. Equal fingerprints mean equal inputs to the model."""
    if text is not None:
        material = text
    elif prompt is not None:
        material = prompt
    else:
        material = json.dumps([{"role": m["role"], "content": m["content"],
                                "name": m.get("name"),
                                **({"images": [[r["sha256"], r.get("offset", 0),
                                                r.get("detail", "auto")] for r in images]}
                                   if (images := m.get("images")) else {})}
                               for m in messages],
                              ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(model.encode() + b"\x00" + material.encode()).hexdigest()[:32]
