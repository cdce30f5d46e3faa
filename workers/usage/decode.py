"""Reading ``conveyor.usage`` (and ``conveyor.feedback``) values in Faust with
Conveyor's own codec. A Faust serializer that raises stops the agent, so
:class:`UsageValueCodec` never raises: a value that does not decode comes out
as :class:`Undecodable`, which the app dead-letters, as every layer does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faust.serializers.codecs import Codec as FaustCodec

from schemas.codec import Codec, EventType, default_codec

__all__ = ["Undecodable", "UsageValueCodec"]


@dataclass(frozen=True)
class Undecodable:
    """A value of the usage topic that is not a UsageRecord."""

    data: bytes
    error: str


class UsageValueCodec(FaustCodec):
    """bytes -> UsageRecord dict (or :class:`Undecodable`); the reverse for tests.
    ``event_type`` "Feedback" reads ``conveyor.feedback`` the same way."""

    def __init__(self, codec: Codec | None = None,
                 event_type: EventType = "UsageRecord") -> None:
        super().__init__()
        self.codec = codec or default_codec()
        self.event_type: EventType = event_type

    def _loads(self, s: bytes) -> Any:
        try:
            return self.codec.decode(s, self.event_type)
        except Exception as exc:  # any failure to read is a poison value, not a crash
            return Undecodable(data=bytes(s), error=f"{type(exc).__name__}: {exc}")

    def _dumps(self, s: Any) -> bytes:
        return self.codec.encode(self.event_type, s)
