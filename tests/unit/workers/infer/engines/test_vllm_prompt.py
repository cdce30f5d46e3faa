"""The prompt the vLLM engine gives vLLM's renderer: the text (or the
beginning-of-sequence token for an empty one) and the tenant's ``cache_salt``,
a field vLLM's V1 engine reads from the prompt and folds into the first
block's hash. vLLM itself runs in the vllm tier (test_vllm.py); here no
engine is started."""

from __future__ import annotations

from typing import Any, cast

from conveyor.registry import Registry
from tests.support.pipeline import TEST_MODELS
from workers.infer.engines.base import GenerationRequest
from workers.infer.engines.vllm import VllmEngine


def prompt_of(**fields: Any) -> dict[str, Any]:
    engine = VllmEngine(Registry.load(TEST_MODELS).resolve("smollm2"))
    engine._bos = [1]  # noqa: SLF001 (what start() reads off the tokenizer)
    request = GenerationRequest(**{"request_id": "r", "kind": "completion", "model": "smollm2",
                                   "max_tokens": 4, **fields})
    return engine._prompt(cast(Any, None), request)  # noqa: SLF001


def test_the_tenant_s_salt_goes_in_the_prompt() -> None:
    assert prompt_of(prompt_text="Once", cache_salt="s1") == {"prompt": "Once",
                                                              "cache_salt": "s1"}
    assert prompt_of(prompt_text="", cache_salt="s1") == {"prompt_token_ids": [1],
                                                          "cache_salt": "s1"}


def test_shared_caches_send_no_salt() -> None:
    """vLLM refuses an empty cache_salt: where caches are shared there is none."""
    assert prompt_of(prompt_text="Once") == {"prompt": "Once"}
