"""The field types the OpenAI request models share: text UTF-8 can hold (a
lone surrogate, JSON ``"\\ud800"``, cannot be written into an event and is
refused with its field's ``param``), and the strict model configuration."""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, ConfigDict

from conveyor.errors import InvalidRequest

__all__ = ["Text", "STRICT", "FUNCTION_NAME", "image_parts", "joined", "json_object"]


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text; it holds a lone surrogate "
                         "(such as \\ud800)") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]

STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

# a function's name, as OpenAI allows it
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


def joined(content: Any) -> str:
    """A content field's text: a string, None (empty) or a list of parts (the
    text parts' texts, joined; an image part holds none)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(getattr(part, "text", "") for part in content)


Image = TypeVar("Image")


def image_parts(content: Any, image: type[Image]) -> list[tuple[int, int, Image]]:
    """Each image part (of type ``image``) of a content field: its index in the
    content, the characters of text before it, the part. A content that is no
    list of parts holds none."""
    out: list[tuple[int, int, Image]] = []
    chars = 0
    for index, part in enumerate(content if isinstance(content, list) else ()):
        if isinstance(part, image):
            out.append((index, chars, part))
        else:
            chars += len(part.text)
    return out


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body read as a JSON object; InvalidRequest (400) when it is not."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply to read.") from None
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("The request body is not valid JSON.") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    return data
