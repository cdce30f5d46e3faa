"""What the llama.cpp engine does with a prompt: render it with the GGUF's chat
template, start an empty one at the beginning-of-sequence token, and weigh
what a cached sequence is worth to it.
"""

from __future__ import annotations

import os

from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

__all__ = ["chat_formatter", "common_prefix", "prompt_or_bos", "reuse_score"]


def common_prefix(cached: list[int], tokens: list[int]) -> int:
    """How many leading ``tokens`` a cache holding ``cached`` holds already."""
    return len(os.path.commonprefix([cached, tokens]))


def reuse_score(cached: list[int], tokens: list[int]) -> int:
    """What a prompt of ``tokens`` gains from a cache holding ``cached``: the
    tokens it reuses, less those of the cached prompt it throws away, and 0
    when that is nothing (an empty cache, or one holding another
    conversation that shares only the template's first tokens with it).
    Among caches that score 0 the caller takes the least recently used: a
    new conversation evicts a stale one, not one still going on.

    A cache holding the whole prompt (all but its last token, which is always
    evaluated) is worth all of it, however long the answer after it: a
    repeated or regenerated prompt would otherwise score 0 once its earlier
    answer was longer than it, and be evaluated afresh in another slot or
    context (its first token 2-5x later), while the answer it throws away is
    the one it is about to give again."""
    shared = common_prefix(cached, tokens)
    if shared and shared >= len(tokens) - 1:
        return shared
    return max(0, shared - (len(cached) - shared))


def prompt_or_bos(llm: Llama, prompt: str) -> str | list[int]:
    """An empty prompt (OpenAI takes ``""``) starts from the beginning-of-sequence
    token: llama.cpp cannot evaluate zero tokens, and a model whose tokenizer adds
    no BOS itself (SmolLM2) would otherwise fail."""
    return prompt if prompt else [llm.token_bos()]


def chat_formatter(llm: Llama) -> Jinja2ChatFormatter | None:
    """The GGUF's own chat template, or None when the file has none."""
    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        return None

    def token_text(token: int) -> str:
        if token < 0:
            return ""
        return llm.detokenize([token], special=True).decode("utf-8", errors="ignore")

    return Jinja2ChatFormatter(
        template=template,
        eos_token=token_text(llm.token_eos()),
        bos_token=token_text(llm.token_bos()),
        add_generation_prompt=True,
    )
