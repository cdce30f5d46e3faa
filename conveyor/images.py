"""What an image part of a message must be, checked with Pillow: one of the
media types Conveyor takes, bytes that decode as the type they claim, within
the pixels allowed; and the prompt tokens an image counts for (OpenAI's rule of
tiles). The rules: docs/api/chat.md#images; why: docs/decisions/0036-images.md.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from conveyor.errors import InvalidRequest

__all__ = ["MEDIA_TYPES", "CheckedImage", "check_image", "image_tokens", "not_seeing"]

# the media types an image part may hold, and Pillow's name of each format
MEDIA_TYPES: dict[str, str] = {"image/png": "PNG", "image/jpeg": "JPEG",
                               "image/webp": "WEBP", "image/gif": "GIF"}
_FORMATS = {fmt: media for media, fmt in MEDIA_TYPES.items()}

# OpenAI's count of an image's tokens: 85 at low detail; at high (and auto) detail
# 85 plus 170 a tile of 512 pixels, the image first scaled within 2048 x 2048,
# then its short side to 768
_BASE_TOKENS = 85
_TILE_TOKENS = 170


@dataclass(frozen=True)
class CheckedImage:
    media_type: str  # the one its bytes are
    width: int
    height: int


def check_image(data: bytes, declared: str | None, max_pixels: int, param: str) -> CheckedImage:
    """The image in ``data``, decoded by Pillow (its header read, its content
    verified, its pixels decoded: CPU work, run it in a thread); an
    :class:`InvalidRequest` naming ``param`` when it is not one of
    :data:`MEDIA_TYPES`, is not the type ``declared`` (a data URL's), is
    broken, or has more than ``max_pixels``."""
    if declared is not None and declared not in MEDIA_TYPES:
        raise InvalidRequest(f"Invalid '{param}': images of type {declared} are not "
                             f"supported; send {', '.join(MEDIA_TYPES)}.", param=param)
    too_many = (f"Invalid '{param}': the image has more than the {max_pixels} pixels "
                "Conveyor accepts")
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt, (width, height) = image.format, image.size
            media_type = _FORMATS.get(fmt or "")
            if media_type is None:
                raise InvalidRequest(f"Invalid '{param}': images of format {fmt} are not "
                                     f"supported; send {', '.join(MEDIA_TYPES)}.", param=param)
            if width * height > max_pixels:
                raise InvalidRequest(f"{too_many} ({width} x {height}).", param=param)
            image.verify()  # the structure and checksums (PNG's CRCs)
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # every pixel decoded: a truncated image fails here
    except InvalidRequest:
        raise
    except Image.DecompressionBombError:  # past Pillow's own bound, told at open
        raise InvalidRequest(f"{too_many}.", param=param) from None
    except UnidentifiedImageError:
        raise InvalidRequest(f"Invalid '{param}': the data is not an image Conveyor can "
                             f"read ({', '.join(MEDIA_TYPES)}).", param=param) from None
    except Exception as exc:  # Pillow's decoders raise what they meet (SyntaxError, OSError)
        raise InvalidRequest(f"Invalid '{param}': the image is broken ({exc}).",
                             param=param) from None
    if declared is not None and declared != media_type:
        raise InvalidRequest(f"Invalid '{param}': the data URL says {declared}, but the "
                             f"data is {media_type}.", param=param)
    return CheckedImage(media_type, width, height)


def not_seeing(model: str, part: str) -> InvalidRequest:
    """The 400 of an image part (``part``) sent to a model that does not
    declare vision, as the gateway and preprocess both answer it."""
    return InvalidRequest(f"The model `{model}` does not read images; '{part}' is an image "
                          "part. Send images to a model that declares vision.", param=part)


def image_tokens(width: int, height: int, detail: str) -> int:
    """The prompt tokens of an image (see the module notes)."""
    if detail == "low":
        return _BASE_TOKENS
    scale = min(1.0, 2048 / max(width, height))
    w, h = width * scale, height * scale
    scale = min(1.0, 768 / min(w, h))
    w, h = w * scale, h * scale
    return _BASE_TOKENS + _TILE_TOKENS * math.ceil(w / 512) * math.ceil(h / 512)
