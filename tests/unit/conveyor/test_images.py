"""What an image part must be (conveyor/images.py), checked on real images."""

from __future__ import annotations

import struct
import zlib

import pytest

from conveyor.errors import InvalidRequest
from conveyor.images import check_image, image_tokens
from tests.support.images import image_bytes

PARAM = "messages[0].content[1]"


@pytest.mark.parametrize(("fmt", "media_type"), [
    ("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_each_media_type_is_read_with_its_size(fmt: str, media_type: str) -> None:
    checked = check_image(image_bytes(fmt, (7, 5)), media_type, 100, PARAM)
    assert (checked.media_type, checked.width, checked.height) == (media_type, 7, 5)
    # a remote image declares nothing: its bytes say what it is
    assert check_image(image_bytes(fmt), None, 100, PARAM).media_type == media_type


def refused(data: bytes, declared: str | None, max_pixels: int = 100) -> str:
    with pytest.raises(InvalidRequest) as caught:
        check_image(data, declared, max_pixels, PARAM)
    assert caught.value.param == PARAM and caught.value.status == 400
    return caught.value.message


def test_a_type_the_bytes_are_not_is_refused() -> None:
    assert "says image/jpeg, but the data is image/png" in refused(image_bytes(), "image/jpeg")


def test_media_types_other_than_four_are_refused() -> None:
    assert "image/svg+xml are not supported" in refused(b"<svg/>", "image/svg+xml")
    assert "format BMP are not supported" in refused(image_bytes("BMP"), None)


def test_bytes_that_are_no_image_or_a_broken_one_are_refused() -> None:
    assert "not an image" in refused(b"hello, world", "image/png")
    broken = bytearray(image_bytes("PNG", (8, 8)))
    broken[-20:-12] = b"\x00" * 8  # the image data's checksum no longer holds
    assert "broken" in refused(bytes(broken), "image/png")
    assert "broken" in refused(image_bytes("JPEG", (8, 8))[:-40], "image/jpeg")  # truncated


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims a size (its pixels are never there): what a bomb sends."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                                0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_more_pixels_than_allowed_are_refused_before_any_is_decoded() -> None:
    assert "more than the 100 pixels Conveyor accepts (11 x 10)" in refused(
        image_bytes("PNG", (11, 10)), None)
    assert "(6000 x 6000)" in refused(png_header(6000, 6000), None, 25_000_000)
    # past Pillow's own bound, which it tells as it opens the file
    assert "more than the 25000000 pixels" in refused(png_header(20000, 20000), None,
                                                        25_000_000)


def test_tokens_follow_openai_s_tiles() -> None:
    assert image_tokens(4096, 4096, "low") == 85
    assert image_tokens(1024, 1024, "high") == 85 + 170 * 4  # 768 x 768: 2 x 2 tiles
    assert image_tokens(2048, 4096, "auto") == 85 + 170 * 6  # 768 x 1536: 2 x 3
    assert image_tokens(3, 2, "auto") == 85 + 170
