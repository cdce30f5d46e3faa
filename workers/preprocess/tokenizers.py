"""The tokenizer of a target model, behind a tiny interface: preprocess measures
prompts with it and renders chat conversations into the model's prompt text.
:class:`GgufTokenizer` reads the vocabulary and chat template of the model's
GGUF file (no weights), counting exactly what llama.cpp will;
:class:`EstimateTokenizer`, for a tokenizer that is not local (an HTTP
upstream), counts about four characters a token and has no template.
:class:`TokenizerCache` builds each model's tokenizer once, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
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

__all__ = ["EstimateTokenizer", "GgufTokenizer", "HfTokenizer", "Tokenizer", "TokenizerCache",
           "load_tokenizer"]

CHARS_PER_TOKEN = 4
# GgufTokenizer._pieces: texts longer than this are tokenized in pieces of this many turns
_SPLIT_ABOVE_CHARS = 4096
_TURNS_PER_CALL = 32
# GgufTokenizer.ids: the characters a token takes at most, for reading no more
# text than the ids asked for can need
_CHARS_PER_ID_AT_MOST = 16


class Tokenizer(Protocol):
    """Counts tokens of a text and renders a conversation for one model."""

    exact: bool
    # the token ids are 0 .. vocab_size - 1 (None: the vocabulary is not known here)
    vocab_size: int | None
    # the chat template is known here (render_chat renders); else the engine renders
    renders: bool

    def count(self, text: str) -> int:
        """The number of tokens of ``text`` (no BOS added)."""
        ...

    def render_chat(self, messages: list[Message]) -> str | None:
        """The prompt text for ``messages`` with the generation prompt
        appended, or None when the model's template is not known here."""
        ...

    def min_count(self, text: str) -> int:
        """A number of tokens ``text`` has at least, found without
        tokenizing it (a long conversation that cannot fit is known at once)."""
        ...

    def ids(self, text: str, limit: int) -> list[int]:
        """The first ``limit`` token ids of ``text`` (no BOS added), as
        :meth:`count` counts them; empty when the ids are not known here."""
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
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# OpenAI's ``developer`` role is the newer name of ``system``; chat templates
# trained before it know only ``system``.
_TEMPLATE_ROLES = {"developer": "system"}


class GgufTokenizer:
    """Exact counts and the chat template of a GGUF model file (loading is
    blocking file I/O: :class:`TokenizerCache` runs it in a thread)."""

    exact: bool = True

    def __init__(self, path: Path) -> None:
        # Imported here: the engine library is heavy and only this class needs it.
        from llama_cpp import Llama

        self.path = path
        self._llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab_size: int | None = self._llm.n_vocab()
        metadata: dict[str, str] = self._llm.metadata
        self.bos_token = self._token_text(self._llm.token_bos())
        self.eos_token = self._token_text(self._llm.token_eos())
        source = metadata.get("tokenizer.chat_template")
        self._template = _template_environment().from_string(source) if source else None
        self.renders = self._template is not None
        self._turn_end = re.compile(re.escape(self.eos_token)) if self.eos_token else None
        controls = sorted({t for t in (self.bos_token, self.eos_token) if t}, key=len,
                          reverse=True)
        self._controls = re.compile("|".join(map(re.escape, controls))) if controls else None

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    def _pieces(self, text: str) -> list[str]:
        """A long ``text`` cut just before every ``_TURNS_PER_CALL``-th turn end
        (the EOS token's text): llama.cpp tokenizes the text between control
        tokens on its own anyway, so the pieces count the same, in linear time
        (docs/decisions/0023-preprocess-in-linear-time.md)."""
        if len(text) <= _SPLIT_ABOVE_CHARS or self._turn_end is None:
            return [text]
        cuts = [m.start() for m in self._turn_end.finditer(text)][_TURNS_PER_CALL::_TURNS_PER_CALL]
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    def count(self, text: str) -> int:
        """Tokens of ``text``, control tokens written in it (the template's
        ``<|im_start|>``) counting as the one token the engine will see."""
        return sum(len(self._tokenize(piece)) for piece in self._pieces(text))

    def min_count(self, text: str) -> int:
        """The control tokens (BOS, EOS) written in ``text``: one token each."""
        if self._controls is None:
            return 0
        return sum(1 for _ in self._controls.finditer(text))

    def _tokenize(self, text: str) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    def ids(self, text: str, limit: int) -> list[int]:
        """Tokenized in the pieces :meth:`count` uses, until ``limit`` ids.
        Only the text that can hold them is read (a token is rarely longer
        than ``_CHARS_PER_ID_AT_MOST`` characters); the ids next to where it
        was cut may differ from the whole text's, so they are left out."""
        margin = _CHARS_PER_ID_AT_MOST
        cut = len(text) > (limit + margin) * margin
        out: list[int] = []
        for piece in self._pieces(text[:(limit + margin) * margin]):
            out.extend(self._tokenize(piece))
            if len(out) >= limit + margin:
                break
        return (out[:-margin] if cut else out)[:limit]

    def render_chat(self, messages: list[Message]) -> str | None:
        if self._template is None:
            return None
        rendered = [{"role": _TEMPLATE_ROLES.get(m["role"], m["role"]), "content": m["content"],
                     **({"name": m["name"]} if m.get("name") else {})} for m in messages]
        try:
            return self._template.render(messages=rendered, add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except _TemplateRejected as exc:
            raise InvalidRequest("The model's chat template does not accept these messages: "
                                 f"{exc.message}", param="messages") from exc


class HfTokenizer:
    """Exact counts from the ``tokenizer.json`` of an encoder's weights (Hugging
    Face ``tokenizers``); no chat template: an embedding model reads inputs."""

    exact: bool = True
    renders: bool = False

    def __init__(self, weights: str) -> None:
        from conveyor.encoder_files import EncoderFiles, locate_weights

        self._tokenizer = EncoderFiles(locate_weights(weights)).tokenizer()
        self.vocab_size: int | None = self._tokenizer.get_vocab_size()

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def render_chat(self, messages: list[Message]) -> str | None:
        return None

    def min_count(self, text: str) -> int:
        return 0

    def ids(self, text: str, limit: int) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids[:limit])


class EstimateTokenizer:
    """About four characters a token; no template (the upstream renders)."""

    exact: bool = False
    vocab_size: int | None = None
    renders: bool = False

    def count(self, text: str) -> int:
        return math.ceil(len(text) / CHARS_PER_TOKEN)

    def render_chat(self, messages: list[Message]) -> str | None:
        return None

    def min_count(self, text: str) -> int:
        return self.count(text)

    def ids(self, text: str, limit: int) -> list[int]:
        return []


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    """Build the tokenizer a registry entry names (blocking for ``gguf``)."""
    if spec.tokenizer == "gguf":
        return GgufTokenizer(spec.gguf_path())
    if spec.tokenizer == "hf" and spec.weights:
        return HfTokenizer(spec.weights)
    return EstimateTokenizer()


class TokenizerCache:
    """One tokenizer per model name, built on first use in a worker thread:
    concurrent first uses share one load; a load that fails is tried again."""

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
