"""The safety checks of the pipeline: a request's input in preprocess, its answer
in postprocess (workers/postprocess/stream.py), as the tenant's policy says
(conveyor/policy/safety.py; docs/decisions/0017-safety-in-levels.md).

Input is every text a model would read and, as level 3, the user turns as one
text; a match fails the request with 400 ``content_policy_violation`` naming
the category, never the term. Level 2 is the classifier's score of what the
user wrote. Personal data a policy redacts is replaced by
:func:`redact_generation` wherever a request enters the log
(docs/decisions/0016-personal-data-redacted-at-the-edge.md). Both are audited
on ``conveyor.audit`` (:func:`policy_audit`), the term left out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from functools import partial
from typing import TypeVar

from conveyor.errors import ContentPolicyViolation
from conveyor.policy.classifier import CATEGORY, classifier
from conveyor.policy.pii import FindMemo, Redactor
from conveyor.policy.rules import Policy
from conveyor.policy.safety import Match, TermList
from conveyor.settings import Settings
from schemas.images import mapped_pieces
from schemas.records import AuditEvent, Envelope, Generation, Message
from topics.catalog import AUDIT
from topics.envelope import now_ms
from workers.outputs import Output

__all__ = ["CLASSIFIED", "OFF_LOOP_CHARS", "blocked_input", "checked_input", "classified_input",
           "input_refusal", "policy_audit", "redact_generation", "redacted", "text_size"]

T = TypeVar("T")

# a level-2 match's "term": the classifier, and its score
CLASSIFIED = "classifier"

# Past this many characters a request's checks run in a worker thread, so the
# event loop serves other requests (docs/decisions/0016-personal-data-redacted-at-the-edge.md).
OFF_LOOP_CHARS = 8_192


def _embedded_texts(generation: Generation) -> list[str]:
    """An embedding request's texts (token ids are not text)."""
    ask = generation.get("embedding")
    return [i for i in ask["inputs"] if isinstance(i, str)] if ask else []


def _texts(generation: Generation) -> Iterator[str]:
    if generation["kind"] == "embedding":
        yield from _embedded_texts(generation)
        return
    if generation["kind"] == "completion":
        yield generation["prompt"] or ""
        return
    for message in generation["messages"]:
        yield message["content"]
        for call in message.get("tool_calls") or ():
            yield call["arguments"]
    tools = generation.get("tools")
    for function in tools["functions"] if tools else ():
        yield f"{function['name']} {function['description']}"


def text_size(generation: Generation, per_message: int = 0) -> int:
    """The characters of a request's messages, tool-call arguments and prompt, and
    ``per_message`` more for each message (what a template adds around a turn)."""
    if generation["kind"] == "embedding":
        return sum(len(t) for t in _embedded_texts(generation))
    if generation["kind"] == "completion":
        return len(generation["prompt"] or "")
    return sum(len(m["content"]) + per_message
               + sum(len(c["arguments"]) for c in m.get("tool_calls") or ())
               for m in generation["messages"])


async def _sized(generation: Generation, check: Callable[[], T]) -> T:
    """``check()`` of ``generation``: at once, or in a worker thread past
    :data:`OFF_LOOP_CHARS`."""
    if text_size(generation) <= OFF_LOOP_CHARS:
        return check()
    return await asyncio.to_thread(check)


async def checked_input(terms: TermList, generation: Generation) -> Match | None:
    """:func:`blocked_input`, in a worker thread for a large request."""
    if terms.empty:
        return None
    return await _sized(generation, partial(blocked_input, terms, generation))


def blocked_input(terms: TermList, generation: Generation) -> Match | None:
    """The first match of ``terms`` in what the model would read, or None: in
    each text (level 1), then in the conversation's user turns read as one
    (level 3: a term spread over two turns)."""
    if terms.empty:
        return None
    for text in _texts(generation):
        found = terms.first(text)
        if found is not None:
            return found
    if generation["kind"] == "chat":
        turns = [m["content"] for m in generation["messages"] if m["role"] == "user"]
        if len(turns) > 1:
            return terms.first("\n".join(turns))
    return None


def _conversation(generation: Generation) -> str:
    if generation["kind"] == "embedding":
        return "\n".join(_embedded_texts(generation))
    if generation["kind"] == "completion":
        return generation["prompt"] or ""
    return "\n".join(m["content"] for m in generation["messages"] if m["role"] == "user")


async def classified_input(threshold: float, generation: Generation) -> Match | None:
    """Level 2: the classifier's verdict on what the user wrote (the user turns
    as one text, or a completion's prompt), a match of its category when it
    scores at or above ``threshold``. Run in a worker thread (milliseconds of
    CPU; the model loads on first use)."""
    text = _conversation(generation)
    if not text.strip():
        return None
    model = await asyncio.to_thread(classifier)
    score = await asyncio.to_thread(model.score, text)
    if score < threshold:
        return None
    return Match(CATEGORY, f"{CLASSIFIED} {score:.3f}", 0, len(text))


def input_refusal(match: Match, param: str = "messages") -> ContentPolicyViolation:
    return ContentPolicyViolation(
        f"The request was blocked by the content policy (category: {match.category}).",
        param=param)


def policy_audit(settings: Settings, envelope: Envelope, action: str, match: Match,
                 policy: Policy, layer: str) -> Output:
    """The audit event of a block (key = tenant)."""
    event = AuditEvent(ts_ms=now_ms(), action=action, tenant=envelope["tenant"],
                       key_id=envelope["key_id"], hash_prefix="", actor=layer,
                       reason=f"content policy: {match.category}",
                       request_id=envelope["request_id"],
                       detail={"category": match.category,
                               "level": "2" if match.term.startswith(CLASSIFIED) else "1",
                               "scopes": ",".join(policy.scopes) or "default",
                               **({"score": match.term.split()[-1]}
                                  if match.term.startswith(CLASSIFIED) else {})})
    return Output(AUDIT.at(settings.kafka), "AuditEvent", event, key=envelope["tenant"] or layer)


def redact_generation(generation: Generation, policy: Policy,
                      memo: FindMemo | None = None) -> tuple[Generation, Redactor]:
    """``generation`` with what ``policy`` redacts replaced, and the redactor
    (its mapping: placeholder -> original); ``memo`` serves texts searched before."""
    redactor = Redactor(policy.redact, region=policy.region, memo=memo)
    ask = generation.get("embedding")
    if generation["kind"] == "embedding" and ask:  # the vectors embed the placeholders
        inputs: list[str | list[int]] = [redactor.redact(i) if isinstance(i, str) else i
                                         for i in ask["inputs"]]
        return {**generation, "embedding": {**ask, "inputs": inputs}}, redactor
    if generation["kind"] == "completion":
        prompt = generation["prompt"]
        return {**generation, "prompt": None if prompt is None else redactor.redact(prompt)}, \
            redactor
    return {**generation, "messages": [_message(m, redactor)
                                       for m in generation["messages"]]}, redactor


async def redacted(generation: Generation, policy: Policy,
                   memo: FindMemo | None = None) -> tuple[Generation, Redactor]:
    """:func:`redact_generation`, in a worker thread for a large request."""
    return await _sized(generation, partial(redact_generation, generation, policy, memo))


def _message(message: Message, redactor: Redactor) -> Message:
    out: Message = {**message, "content": redactor.redact(message["content"])}
    images = message.get("images")
    if images:  # the text between images redacted piece by piece: each stays in place
        out["content"], out["images"] = mapped_pieces(message["content"], images,
                                                      redactor.redact)
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [{**call, "arguments": redactor.redact(call["arguments"])}
                             for call in calls]
    return out
