"""The pure functions of preprocess, measured with SmolLM2's real tokenizer."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_cpp import Llama

from conveyor.errors import ContextLengthExceeded, InvalidRequest
from conveyor.registry import ModelSpec, Registry
from conveyor.settings import load_settings
from schemas.records import Generation, Message
from tests.support.factories import generation
from workers.preprocess.normalize import (
    fingerprint,
    fit_prompt,
    measure_messages,
    normalize_generation,
    trim_to_context,
)
from workers.preprocess.tokenizers import (
    EstimateTokenizer,
    GgufTokenizer,
    Tokenizer,
    TokenizerCache,
)

CONTEXT = 2048
DEFAULT_MAX = 256


@pytest.fixture(scope="module")
def smollm2() -> ModelSpec:
    spec = Registry.load(load_settings().process.models_file).find("smollm2")
    assert spec is not None and spec.tokenizer == "gguf"
    return spec


@pytest.fixture(scope="module")
def tokenizer(smollm2: ModelSpec) -> GgufTokenizer:
    return GgufTokenizer(smollm2.gguf_path())


@pytest.fixture(scope="module")
def llama(smollm2: ModelSpec) -> Iterator[Llama]:
    llm = Llama(model_path=str(smollm2.gguf_path()), vocab_only=True, verbose=False)
    yield llm


def msg(role: str, content: str) -> Message:
    return Message(role=role, content=content, name=None, tool_calls=None, tool_call_id=None)


def chat(messages: list[Any], max_tokens: int | None = None) -> Generation:
    return generation(messages, max_tokens=max_tokens)


def completion(prompt: Any, max_tokens: int | None = None) -> Generation:
    return {**chat([], max_tokens), "kind": "completion", "prompt": prompt}


def long_turn(i: int) -> str:
    return f"Turn {i}: " + " ".join(f"word{i}x{j} alpha beta gamma" for j in range(25))


def conversation(turns: int) -> list[Message]:
    """A system prompt, then user/assistant pairs, ending with a user question."""
    messages = [msg("system", "You are terse.")]
    for i in range(turns):
        messages.append(msg("user" if i % 2 == 0 else "assistant", long_turn(i)))
    messages.append(msg("user", "And the final question?"))
    return messages


# -- validation and normalisation -------------------------------------------


def test_nfc_and_nul_stripping_in_messages() -> None:
    out = normalize_generation(chat([msg("user", "cafe\u0301\x00 ok")]))
    assert out["messages"][0]["content"] == "caf\u00e9 ok"


def test_nfc_in_completion_prompt() -> None:
    out = normalize_generation(completion("e\u0301"))
    assert out["prompt"] == "\u00e9"


def test_normalisation_does_not_change_the_input() -> None:
    original = chat([msg("user", "e\u0301")])
    normalize_generation(original)
    assert original["messages"][0]["content"] == "e\u0301"


def test_bad_role_names_the_field() -> None:
    messages = [msg("system", "s"), msg("user", "u"), msg("wizard", "w")]
    with pytest.raises(InvalidRequest) as err:
        normalize_generation(chat(messages))
    assert err.value.param == "messages[2].role"
    assert "'wizard'" in err.value.message and err.value.status == 400


def test_every_openai_role_is_accepted() -> None:
    roles = ["system", "developer", "user", "assistant", "tool"]
    out = normalize_generation(chat([msg(r, r) for r in roles]))
    assert [m["role"] for m in out["messages"]] == roles


def test_empty_messages_rejected() -> None:
    with pytest.raises(InvalidRequest) as err:
        normalize_generation(chat([]))
    assert err.value.param == "messages"


def test_content_must_be_a_string() -> None:
    with pytest.raises(InvalidRequest) as err:
        normalize_generation(chat([{"role": "user", "content": [{"type": "text"}]}]))
    assert err.value.param == "messages[0].content"


def test_content_that_is_not_valid_text_rejected() -> None:
    with pytest.raises(InvalidRequest) as err:
        normalize_generation(chat([msg("user", "ok"), msg("user", "bad \ud800")]))
    assert err.value.param == "messages[1].content"
    assert "surrogate" in err.value.message


def test_completion_needs_a_prompt() -> None:
    with pytest.raises(InvalidRequest) as err:
        normalize_generation(completion(None))
    assert err.value.param == "prompt"


def test_max_tokens_below_one_rejected() -> None:
    with pytest.raises(InvalidRequest) as err:
        normalize_generation(chat([msg("user", "hi")], max_tokens=0))
    assert err.value.param == "max_tokens"


# -- tokenizers ---------------------------------------------------------------


def test_counts_match_llama_tokenizer(tokenizer: GgufTokenizer, llama: Llama) -> None:
    texts = ["Hello, world!", "caf\u00e9 \u65e5\u672c\u8a9e", "<|im_start|>user\nhi<|im_end|>", ""]
    for text in texts:
        expected = len(llama.tokenize(text.encode(), add_bos=False, special=True))
        assert tokenizer.count(text) == expected
    assert tokenizer.exact is True


def test_rendered_prompt_is_chatml_with_generation_prompt(tokenizer: GgufTokenizer) -> None:
    text = tokenizer.render_chat([msg("system", "Be kind."), msg("user", "Hi")])
    assert text == (
        "<|im_start|>system\nBe kind.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"


def test_template_adds_its_default_system_prompt(tokenizer: GgufTokenizer) -> None:
    text = tokenizer.render_chat([msg("user", "Hi")])
    assert text is not None and text.startswith("<|im_start|>system\nYou are a helpful")


def test_developer_renders_as_system(tokenizer: GgufTokenizer) -> None:
    text = tokenizer.render_chat([msg("developer", "Rules."), msg("user", "Hi")])
    assert text is not None and text.startswith("<|im_start|>system\nRules.<|im_end|>")


def test_estimate_tokenizer() -> None:
    est = EstimateTokenizer()
    assert est.exact is False
    assert est.count("abcde") == 2 and est.count("") == 0
    assert est.render_chat([msg("user", "hi")]) is None
    text, tokens = measure_messages([msg("user", "abcdefgh")], est)
    assert text is None and tokens == 3 + 4 + 2


async def test_tokenizer_cache_loads_each_model_once(smollm2: ModelSpec) -> None:
    calls: list[str] = []

    def loader(spec: ModelSpec) -> Tokenizer:
        calls.append(spec.name)
        return EstimateTokenizer()

    cache = TokenizerCache(loader)
    first, second = await asyncio.gather(cache.get(smollm2), cache.get(smollm2))
    assert first is second and await cache.get(smollm2) is first
    assert calls == [smollm2.name]


async def test_tokenizer_cache_retries_a_failed_load() -> None:
    spec = ModelSpec(name="missing", pool="cpu", context_length=8, tokenizer="gguf",
                     gguf=str(Path("/nonexistent/model.gguf")))
    attempts: list[int] = []

    def loader(spec: ModelSpec) -> Tokenizer:
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("not there")
        return EstimateTokenizer()

    cache = TokenizerCache(loader)
    with pytest.raises(OSError):
        await cache.get(spec)
    assert isinstance(await cache.get(spec), EstimateTokenizer)
    assert len(attempts) == 2


async def test_tokenizer_cache_builds_the_real_gguf_tokenizer(smollm2: ModelSpec) -> None:
    tok = await TokenizerCache().get(smollm2)
    assert isinstance(tok, GgufTokenizer) and tok.exact


# -- fitting to the context window -------------------------------------------


def test_short_conversation_kept_whole_with_default_budget(tokenizer: GgufTokenizer) -> None:
    messages = [msg("system", "Be kind."), msg("user", "Hi")]
    fit = trim_to_context(messages, tokenizer, CONTEXT, None, DEFAULT_MAX)
    assert fit.dropped == 0 and fit.messages == messages
    assert fit.max_tokens == DEFAULT_MAX
    assert fit.text is not None and fit.text.endswith("<|im_start|>assistant\n")
    assert fit.tokens == tokenizer.count(fit.text)


def test_default_budget_is_the_room_left(tokenizer: GgufTokenizer) -> None:
    messages = [msg("user", long_turn(0) * 4)]
    _, tokens = measure_messages(messages, tokenizer)
    context = tokens + 10
    fit = trim_to_context(messages, tokenizer, context, None, DEFAULT_MAX)
    assert fit.max_tokens == 10 and fit.dropped == 0


def test_requested_budget_kept(tokenizer: GgufTokenizer) -> None:
    fit = trim_to_context([msg("user", "Hi")], tokenizer, CONTEXT, 1000, DEFAULT_MAX)
    assert fit.max_tokens == 1000


def test_trimming_keeps_system_and_last_and_drops_the_oldest(
    tokenizer: GgufTokenizer,
) -> None:
    messages = conversation(30)
    _, full = measure_messages(messages, tokenizer)
    assert full > CONTEXT  # the test's premise

    fit = trim_to_context(messages, tokenizer, CONTEXT, 300, DEFAULT_MAX)

    assert fit.dropped > 0 and len(fit.messages) == len(messages) - fit.dropped
    assert fit.messages[0] == messages[0]  # the system prompt
    assert fit.messages[-1] == messages[-1]  # the question
    assert fit.messages[1:] == messages[1 + fit.dropped:]  # a tail: the oldest went
    assert fit.messages[1]["role"] == "user"  # no answer without its question
    assert fit.tokens + fit.max_tokens <= CONTEXT and fit.max_tokens == 300
    assert fit.text is not None and fit.tokens == tokenizer.count(fit.text)
    # The fewest drops: putting the last dropped pair back does not fit.
    again = [messages[0], *messages[1 + fit.dropped - 2:]]
    _, more = measure_messages(again, tokenizer)
    assert more + 300 > CONTEXT


def test_trimming_keeps_developer_messages_anywhere(tokenizer: GgufTokenizer) -> None:
    messages = conversation(30)
    messages.insert(5, msg("developer", "Answer in French."))
    fit = trim_to_context(messages, tokenizer, CONTEXT, None, DEFAULT_MAX)
    assert fit.dropped > 0
    assert msg("developer", "Answer in French.") in fit.messages
    assert fit.tokens < CONTEXT


def test_one_huge_message_exceeds_the_context(tokenizer: GgufTokenizer) -> None:
    messages = [msg("system", "s"), msg("user", "hello world " * 3000)]
    with pytest.raises(ContextLengthExceeded) as err:
        trim_to_context(messages, tokenizer, CONTEXT, None, DEFAULT_MAX)
    exc = err.value
    assert exc.status == 400 and exc.code == "context_length_exceeded"
    assert exc.param == "messages"
    assert exc.message.startswith("This model's maximum context length is 2048 tokens.")


def test_max_tokens_too_big_exceeds_the_context(tokenizer: GgufTokenizer) -> None:
    messages = [msg("user", "Hi")]
    _, tokens = measure_messages(messages, tokenizer)
    with pytest.raises(ContextLengthExceeded) as err:
        trim_to_context(messages, tokenizer, CONTEXT, 4000, DEFAULT_MAX)
    assert err.value.message == (
        f"This model's maximum context length is 2048 tokens. However, you requested "
        f"{tokens + 4000} tokens ({tokens} in the messages, 4000 in the completion). "
        "Please reduce the length of the messages or completion."
    )


def test_completion_prompt_is_measured_not_trimmed(tokenizer: GgufTokenizer) -> None:
    fit = fit_prompt("Once upon a time", tokenizer, CONTEXT, None, DEFAULT_MAX)
    assert fit.text == "Once upon a time" and fit.max_tokens == DEFAULT_MAX
    assert fit.tokens == tokenizer.count("Once upon a time")
    with pytest.raises(ContextLengthExceeded) as err:
        fit_prompt("hello world " * 3000, tokenizer, CONTEXT, None, DEFAULT_MAX)
    assert err.value.param == "prompt"


def test_estimated_completion_has_no_text() -> None:
    fit = fit_prompt("a" * 40, EstimateTokenizer(), CONTEXT, 5, DEFAULT_MAX)
    assert fit.text is None and fit.tokens == math.ceil(40 / 4) and fit.max_tokens == 5


# -- fingerprint --------------------------------------------------------------


def test_fingerprint() -> None:
    a = fingerprint("m", "prompt", [], None)
    assert len(a) == 32 and int(a, 16) >= 0
    assert a == fingerprint("m", "prompt", [], None)
    assert a != fingerprint("other", "prompt", [], None)
    assert a != fingerprint("m", "prompt!", [], None)
    by_messages = fingerprint("m", None, [msg("user", "hi")], None)
    assert by_messages == fingerprint("m", None, [msg("user", "hi")], None)
    assert by_messages != fingerprint("m", None, [msg("user", "ho")], None)


class CountingTokenizer:
    """The real tokenizer, recording how many characters it was asked to tokenize."""

    def __init__(self, inner: GgufTokenizer) -> None:
        self.inner = inner
        self.exact = inner.exact
        self.tokenized = 0

    def count(self, text: str) -> int:
        self.tokenized += len(text)
        return self.inner.count(text)

    def render_chat(self, messages: list[Message]) -> str | None:
        return self.inner.render_chat(messages)

    def min_count(self, text: str) -> int:
        return self.inner.min_count(text)


def test_a_long_conversation_is_counted_exactly_in_pieces(
        tokenizer: GgufTokenizer, llama: Llama) -> None:
    turns = [msg("user" if i % 2 == 0 else "assistant", f"turn {i}: héllo <|im_end|> 日本\n")
             for i in range(400)]
    text = tokenizer.render_chat(turns)
    assert text is not None
    whole = llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    assert tokenizer.count(text) == len(whole)


def test_trimming_a_huge_history_tokenizes_about_what_is_kept(
        tokenizer: GgufTokenizer) -> None:
    """10,000 short turns: the work follows what is kept (the context), not
    the history: the history is never tokenized whole, let alone per cut."""
    turns = [msg("user" if i % 2 == 0 else "assistant", f"message number {i}")
             for i in range(10_000)]
    counting = CountingTokenizer(tokenizer)
    fit = trim_to_context(turns, counting, CONTEXT, None, DEFAULT_MAX)
    assert fit.dropped > 9_000 and fit.messages[-1] == turns[-1]
    assert fit.text is not None and len(fit.text) * 40 > counting.tokenized
