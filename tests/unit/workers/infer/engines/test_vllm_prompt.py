"""The prompt the vLLM engine gives vLLM's renderer: the text (or the
beginning-of-sequence token for an empty one) and the tenant's ``cache_salt``,
a field vLLM's V1 engine reads from the prompt and folds into the first
block's hash; a chat with images in vLLM's multimodal form. vLLM itself runs in
the vllm tier (test_vllm.py); here no engine is started."""

from __future__ import annotations

import io
from typing import Any, cast

from PIL import Image

from conveyor.registry import Registry
from tests.support.images import image_bytes
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


class _Template:
    """vLLM's tokenizer at the seam: its chat template renders what it is given
    (a vision model's renders an image part as its placeholder)."""

    def __init__(self) -> None:
        self.chats: list[Any] = []

    def apply_chat_template(self, chat: Any, tokenize: bool, add_generation_prompt: bool) -> str:
        self.chats.append(chat)
        return "".join("<image>" if p["type"] == "image" else p["text"]
                       for m in chat for p in m["content"])


class _Llm:
    def __init__(self) -> None:
        self.tokenizer = _Template()

    def get_tokenizer(self) -> _Template:
        return self.tokenizer


async def test_images_go_as_multi_modal_data_in_order_with_the_template_s_placeholders(
        ) -> None:
    engine = VllmEngine(Registry.load(TEST_MODELS).resolve("smollm2"))
    png, gif = image_bytes("PNG", (4, 3)), image_bytes("GIF", (2, 2))
    refs = [{"file_id": "f1", "media_type": "image/png", "bytes": len(png), "sha256": "a",
             "width": 4, "height": 3, "offset": 5, "part": "messages[0].content[1]"},
            {"file_id": "f2", "media_type": "image/gif", "bytes": len(gif), "sha256": "b",
             "width": 2, "height": 2, "offset": 9, "part": "messages[0].content[3]"}]
    request = GenerationRequest(
        request_id="r", kind="chat", model="smollm2", max_tokens=4, cache_salt="s1",
        messages=({"role": "user", "content": "This: and that", "images": refs},),
        images={"a": png, "b": gif})
    llm = _Llm()
    prompt = await engine._seeing(cast(Any, llm), request)  # noqa: SLF001
    assert prompt["prompt"] == "This:<image> and<image> that"
    assert prompt["cache_salt"] == "s1"
    assert llm.tokenizer.chats == [[{"role": "user", "content": [
        {"type": "text", "text": "This:"}, {"type": "image"}, {"type": "text", "text": " and"},
        {"type": "image"}, {"type": "text", "text": " that"}]}]]
    first, second = prompt["multi_modal_data"]["image"]
    assert isinstance(first, Image.Image) and (first.size, first.mode) == ((4, 3), "RGB")
    assert second.size == (2, 2)
    assert first.tobytes() == Image.open(io.BytesIO(png)).convert("RGB").tobytes()
