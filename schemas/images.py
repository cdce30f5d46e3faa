"""How a message's text and its images interleave: each
:class:`~schemas.records.ImageRef` stands at its ``offset`` in the text, so the
text can be cut into the pieces between the images, each changed on its own
(normalised, redacted), and joined again with the offsets moved to match. Why
by offset: docs/decisions/0036-images.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from schemas.records import ImageRef, Message

__all__ = ["first_image", "text_pieces", "mapped_pieces"]


def text_pieces(text: str, refs: Sequence[ImageRef]) -> list[str]:
    """``text`` cut at its images' offsets: one piece more than the images,
    the i-th piece standing before the i-th image (an offset before the last
    one's, or past the text, is taken as the nearest place that is not)."""
    pieces, start = [], 0
    for ref in refs:
        at = min(max(int(ref.get("offset", 0)), start), len(text))
        pieces.append(text[start:at])
        start = at
    pieces.append(text[start:])
    return pieces


def mapped_pieces(text: str, refs: Sequence[ImageRef], change: Callable[[str], str]
                  ) -> tuple[str, list[ImageRef]]:
    """``text`` with ``change`` applied to each piece between its images
    (:func:`text_pieces`), and copies of the images with their offsets in the
    changed text: each image stays between the same characters."""
    pieces = text_pieces(text, refs)
    out, moved = "", []
    for piece, ref in zip(pieces, refs, strict=False):
        out += change(piece)
        copy = ref.copy()
        copy["offset"] = len(out)
        moved.append(copy)
    return out + change(pieces[-1]), moved


def first_image(messages: Sequence[Message]) -> ImageRef | None:
    """The first image of ``messages``, if any."""
    return next((ref for m in messages for ref in m.get("images") or ()), None)
