"""Real images made with Pillow, for the tests of image parts."""

from __future__ import annotations

import base64
import io

from PIL import Image

__all__ = ["image_bytes", "data_url"]


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (3, 2),
                color: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"
