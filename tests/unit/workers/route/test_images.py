"""A request with images falls back only to models that declare vision."""

from __future__ import annotations

from typing import Any

from conveyor.policy.rules import DEFAULT_SCOPE, PolicyBook
from conveyor.registry import Registry
from conveyor.settings import load_settings
from schemas.records import ImageRef, Prepared
from tests.support.schedule_tasks import full_task
from workers.route.layer import RouteLayer

MODELS = '''
[models."eyes"]
pool = "gpu"
context_length = 8192
vision = true
fallbacks = ["text", "small-eyes"]
[models."text"]
pool = "cpu"
context_length = 8192
[models."small-eyes"]
pool = "cpu-eyes"
context_length = 8192
vision = true
'''


async def test_only_vision_models_are_the_fallbacks_of_a_request_with_images() -> None:
    layer = RouteLayer(load_settings(topic_prefix="r"), Registry.parse(MODELS, "t"))
    image = ImageRef(file_id="file-" + "a" * 24, media_type="image/png", bytes=10,
                     sha256="a" * 64, width=1, height=1)
    task = full_task("r1")
    fallbacks = {}
    for name, images in (("plain", None), ("seeing", [image])):
        message = {"role": "user", "content": "What?", "name": None, "images": images}
        event = Prepared(envelope=task["envelope"],
                         generation={**task["generation"], "model": "eyes",
                                     "messages": [message]},  # type: ignore[typeddict-item]
                         prompt=task["prompt"])
        [out] = await layer.handle(event, None)
        fallbacks[name] = [f["model"] for f in out.record["route"]["fallbacks"]]
    assert fallbacks == {"plain": ["text", "small-eyes"], "seeing": ["small-eyes"]}


async def test_a_request_with_images_is_never_answered_from_the_semantic_cache() -> None:
    book = PolicyBook()
    book.set(DEFAULT_SCOPE, "[cache]\nsemantic = true\n")
    layer = RouteLayer(load_settings(topic_prefix="r"), Registry.parse(MODELS, "t"),
                       policies=book)
    looked_up: list[str] = []

    async def semantic(envelope: Any, event: Prepared, *rest: Any) -> tuple[None, Any]:
        looked_up.append(event["generation"]["messages"][0]["content"])
        return None, event["prompt"]

    layer._semantic = semantic  # type: ignore[method-assign]
    image = ImageRef(file_id="file-" + "a" * 24, media_type="image/png", bytes=10,
                     sha256="a" * 64, width=1, height=1)
    task = full_task("r1")
    for text, images in (("What is this?", None), ("What is in this picture?", [image])):
        message = {"role": "user", "content": text, "name": None, "images": images}
        await layer.handle(Prepared(envelope=task["envelope"],
                                    generation={**task["generation"], "model": "eyes",
                                                "messages": [message]},  # type: ignore[typeddict-item]
                                    prompt=task["prompt"]), None)
    # greedy both, the policy on: only the text alone is looked up by its meaning
    assert looked_up == ["What is this?"]
