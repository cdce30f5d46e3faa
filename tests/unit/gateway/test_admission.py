"""What admission reserves of a tenant's tokens before preprocess counts them."""

from __future__ import annotations

from conveyor.images import image_tokens
from conveyor.registry import Registry
from gateway.admission import estimate_tokens
from tests.support.factories import generation
from tests.support.pipeline import TEST_MODELS


def test_a_chat_s_images_are_reserved_as_they_will_be_counted() -> None:
    registry = Registry.load(TEST_MODELS)
    ref = {"file_id": "file-" + "a" * 24, "media_type": "image/png", "bytes": 10,
           "sha256": "a" * 64, "width": 2048, "height": 1024, "offset": 0,
           "part": "messages[0].content[1]"}
    plain = generation([{"role": "user", "content": "What is this?"}], max_tokens=10)
    seeing = generation([{"role": "user", "content": "What is this?",
                          "images": [ref, {**ref, "detail": "low"}]}], max_tokens=10)
    assert estimate_tokens(seeing, registry) - estimate_tokens(plain, registry) == \
        image_tokens(2048, 1024, "auto") + 85
