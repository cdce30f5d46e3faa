"""The fixed prompts ``bench.reference`` runs through each engine and precision.

Every example question of the README is here (``readme=True``), as the README
sends it (the system prompt of the curl example included), beside chat
questions of several kinds (facts, lists, short writing, code, arithmetic)
and plain completions. A prompt is only ever run greedily, so each has one
answer per engine and precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypedDict

__all__ = ["PROMPTS", "ReferencePrompt"]


class Message(TypedDict):
    """A chat message as the API takes it (infra/ imports nothing of Conveyor)."""

    role: str
    content: str


@dataclass(frozen=True)
class ReferencePrompt:
    id: str
    kind: Literal["chat", "completion"]
    prompt: str = ""  # a completion's text
    messages: tuple[Message, ...] = field(default_factory=tuple)  # a chat's
    readme: bool = False  # an example of the README


def _chat(id: str, question: str, system: str | None = None,
          readme: bool = False) -> ReferencePrompt:
    asked: Message = {"role": "user", "content": question}
    told: tuple[Message, ...] = ({"role": "system", "content": system},) if system else ()
    return ReferencePrompt(id, "chat", messages=(*told, asked), readme=readme)


def _completion(id: str, prompt: str, readme: bool = False) -> ReferencePrompt:
    return ReferencePrompt(id, "completion", prompt=prompt, readme=readme)


PROMPTS: tuple[ReferencePrompt, ...] = (
    # the README's examples
    _chat("readme-france", "What is the capital of France?",
          system="You are a helpful assistant.", readme=True),
    _chat("readme-haiku", "Write a haiku about conveyor belts.", readme=True),
    _chat("readme-count", "Count to five.", readme=True),
    _chat("readme-hi", "Hi", readme=True),
    _chat("readme-colour", "Name a colour.", readme=True),
    _chat("readme-fruit", "Name a fruit.", readme=True),
    _chat("readme-story", "Tell a long story.", readme=True),
    _chat("readme-limerick", "Write a limerick.", readme=True),
    _completion("readme-france-completion", "The capital of France is", readme=True),
    # chat
    _chat("france-no-system", "What is the capital of France?"),
    _chat("message-queue", "Explain what a message queue is in two sentences."),
    _chat("autumn-haiku", "Write a haiku about autumn leaves."),
    _chat("paperclip", "List three uses of a paperclip."),
    _chat("sky", "Why is the sky blue?"),
    _chat("bicycle", "Describe how a bicycle works to a child."),
    _chat("eggs", "Give me a short recipe for scrambled eggs."),
    _chat("planets", "How many planets are in the solar system?"),
    _chat("arithmetic", "What is 12 plus 7?"),
    _chat("python-reverse", "Write a Python function that reverses a string."),
    _chat("germany", "What is the capital of Germany?",
          system="You are a helpful assistant."),
    # completions
    _completion("once-upon", "Once upon a time, there was a"),
    _completion("water-boils", "Water boils at a temperature of"),
    _completion("largest-planet", "The largest planet in the solar system is"),
    _completion("python-def", "def add(a, b):\n"),
)
