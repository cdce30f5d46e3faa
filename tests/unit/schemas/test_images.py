"""How a message's text and its images interleave (schemas/images.py)."""

from __future__ import annotations

from schemas.images import first_image, mapped_pieces, text_pieces
from schemas.records import ImageRef, Message


def ref(offset: int, name: str = "a") -> ImageRef:
    return ImageRef(file_id=f"file-{name}", media_type="image/png", bytes=1, sha256=name,
                    width=1, height=1, offset=offset)


def test_a_text_is_cut_where_its_images_stand_offsets_out_of_place_clamped() -> None:
    assert text_pieces("abcdef", []) == ["abcdef"]
    assert text_pieces("abcdef", [ref(2), ref(2), ref(4)]) == ["ab", "", "cd", "ef"]
    # before the last image's offset, or past the text: the nearest place that is not
    assert text_pieces("abcdef", [ref(4), ref(1), ref(99)]) == ["abcd", "", "ef", ""]


def test_changed_pieces_keep_each_image_between_the_same_characters() -> None:
    refs = [ref(3, "x"), ref(5, "y")]
    text, moved = mapped_pieces("ab\0c\0de", refs, lambda piece: piece.replace("\0", ""))
    assert text == "abcde"
    assert [(r["sha256"], r["offset"]) for r in moved] == [("x", 2), ("y", 3)]
    assert [r["offset"] for r in refs] == [3, 5]  # the images given are not changed


def test_the_first_image_of_the_messages() -> None:
    messages = [Message(role="system", content="s"),
                Message(role="user", content="u", images=[ref(0, "b"), ref(0, "c")])]
    assert first_image(messages) == ref(0, "b")
    assert first_image(messages[:1]) is None
