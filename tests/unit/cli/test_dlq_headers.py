"""A dead letter of a record of many requests' events goes back with the
headers it was written with (cli/dlq.py), made again from its value: a keyed
lookup finds it, and schedule's finish follower reads what it ends."""

from __future__ import annotations

from typing import Any, cast

from conveyor.settings import load_settings
from gateway.dead_letters import _headers
from schemas.codec import default_codec
from tests.support.factories import chunk
from topics.catalog import CONTROL, TOKENS
from topics.reader import ENDED_IDS, REQUEST_IDS


def letter(topic: str, value: bytes | None) -> Any:
    return {"layer": "postprocess", "topic": topic, "partition": 1, "offset": 7, "key": None,
            "value": value, "error": "x", "ts_ms": 1}


def test_a_tokens_letter_goes_back_with_its_request_and_ended_ids() -> None:
    settings, codec = load_settings(topic_prefix="t"), default_codec()
    chunks = [chunk("a", 0, "x"), chunk("b", 3, "", finish="stop")]
    value = TOKENS.encode(codec, TOKENS.pack(chunks))
    headers = dict(_headers(settings, codec, letter("t.tokens", value)) or [])
    assert headers == {REQUEST_IDS: b"a,b", ENDED_IDS: b"b"}
    # a letter of a topic of single events, or a value that does not decode: none
    cancel = CONTROL.encode(codec, cast(Any, {"request_id": "r", "action": "cancel",
                                              "reason": "", "ts_ms": 1}))
    assert _headers(settings, codec, letter("t.control", cancel)) is None
    assert _headers(settings, codec, letter("t.tokens", b"junk")) is None
