"""The tokenizer of a target model, behind a tiny interface.

Preprocess measures prompts with it and renders chat conversations into the
model's prompt text. Two implementations:

- :class:`GgufTokenizer` reads the vocabulary and the chat template from the
  model's GGUF file (``vocab_only``: no weights are loaded, a few tens of
  milliseconds and a few megabytes). Counts are exact: they are what
  llama.cpp will count when it runs the same text.
- :class:`EstimateTokenizer` is for models whose tokenizer is not local (an
  HTTP upstream): about four characters a token, and no template.

:class:`TokenizerCache` builds each model's tokenizer once, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn, Protocol

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from conveyor.errors import InvalidRequest
from conveyor.registry import ModelSpec
from schemas.records import Message

__all__ = [
    "EstimateTokenizer",
    "GgufTokenizer",
    "Tokenizer",
    "TokenizerCache",
    "load_tokenizer",
]

CHARS_PER_TOKEN = 4


class Tokenizer(Protocol):
    """Counts tokens of a text and renders a conversation for one model."""

    exact: bool

    def count(self, text: str) -> int:
        """The number of tokens of ``text`` (no BOS added)."""
        ...

    def render_chat(self, messages: list[Message]) -> str | None:
        """The prompt text for ``messages`` with the generation prompt
        appended, or None when the model's template is not known here."""
        ...


class _TemplateRejected(jinja2.TemplateError):
    """A chat template called ``raise_exception``: it refuses these messages."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRejected(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Like Hugging Face's: no HTML escaping, non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The environment Hugging Face's ``apply_chat_template`` renders in, so a
    template written for it renders the same here. Sandboxed: the template
    comes from a model file, and a file is untrusted input."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# OpenAI's ``developer`` role is the newer name of ``system``; chat templates
# trained before it know only ``system``.
_TEMPLATE_ROLES = {"developer": "system"}


class GgufTokenizer:
    """Exact counts and the chat template of a GGUF model file.

    Loading reads the vocabulary only (blocking file I/O: call it through
    :class:`TokenizerCache`, which runs it in a thread). Counting and
    rendering afterwards are pure CPU work of microseconds for prompts of a
    few thousand tokens, fine to run on the event loop.
    """

    exact: bool = True

    def __init__(self, path: Path) -> None:
        # Imported here: the engine library is heavy and only this class needs it.
        from llama_cpp import Llama

        self.path = path
        self._llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        metadata: dict[str, str] = self._llm.metadata
        self.bos_token = self._token_text(self._llm.token_bos())
        self.eos_token = self._token_text(self._llm.token_eos())
        source = metadata.get("tokenizer.chat_template")
        self._template = _template_environment().from_string(source) if source else None

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    def count(self, text: str) -> int:
        # special=True: control tokens written in the text (the template's
        # <|im_start|>) count as the one token the engine will see.
        return len(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def render_chat(self, messages: list[Message]) -> str | None:
        if self._template is None:
            return None
        rendered = [
            {
                "role": _TEMPLATE_ROLES.get(m["role"], m["role"]),
                "content": m["content"],
                **({"name": m["name"]} if m.get("name") else {}),
            }
            for m in messages
        ]
        try:
            return self._template.render(
                messages=rendered,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except _TemplateRejected as exc:
            raise InvalidRequest(
                f"The model's chat template does not accept these messages: {exc.message}",
                param="messages",
            ) from exc


class EstimateTokenizer:
    """About four characters a token; no template (the upstream renders)."""

    exact: bool = False

    def count(self, text: str) -> int:
        return math.ceil(len(text) / CHARS_PER_TOKEN)

    def render_chat(self, messages: list[Message]) -> str | None:
        return None


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    """Build the tokenizer a registry entry names (blocking for ``gguf``)."""
    if spec.tokenizer == "gguf":
        return GgufTokenizer(spec.gguf_path())
    return EstimateTokenizer()


class TokenizerCache:
    """One tokenizer per model name, built on first use in a worker thread.

    Concurrent first uses of a model share one load; a load that fails is
    forgotten, so the next request tries again.
    """

    def __init__(self, loader: Callable[[ModelSpec], Tokenizer] = load_tokenizer) -> None:
        self._loader = loader
        self._loaded: dict[str, Tokenizer] = {}
        self._loading: dict[str, asyncio.Future[Tokenizer]] = {}

    async def get(self, spec: ModelSpec) -> Tokenizer:
        tokenizer = self._loaded.get(spec.name)
        if tokenizer is not None:
            return tokenizer
        future = self._loading.get(spec.name)
        if future is None:
            future = asyncio.ensure_future(asyncio.to_thread(self._loader, spec))
            self._loading[spec.name] = future
        try:
            tokenizer = await asyncio.shield(future)
        finally:
            if future.done():
                self._loading.pop(spec.name, None)
        self._loaded[spec.name] = tokenizer
        return tokenizer
