"""The images of a chat request in preprocess: refused for a model that does
not declare vision (the gateway refused it already; the registry may have
changed since, and a batch's or a replayed event reaches only this check),
and their prompt tokens (conveyor/images.py)."""

from __future__ import annotations

from conveyor.images import image_tokens, not_seeing
from conveyor.registry import ModelSpec
from schemas.images import first_image
from schemas.records import Generation, Message

__all__ = ["check_vision", "has_images", "images_tokens"]


def has_images(messages: list[Message]) -> bool:
    return first_image(messages) is not None


def check_vision(generation: Generation, spec: ModelSpec) -> None:
    """A request with images is for a model that reads them."""
    image = first_image(generation["messages"]) if generation["kind"] == "chat" else None
    if image is not None and not spec.vision:
        raise not_seeing(generation["model"], image.get("part") or "messages")


def images_tokens(message: Message) -> int:
    """The prompt tokens of a message's images."""
    return sum(image_tokens(ref["width"], ref["height"], ref.get("detail") or "auto")
               for ref in message.get("images") or ())
