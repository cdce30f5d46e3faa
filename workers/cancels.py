"""The cancels the layers act on, followed from ``conveyor.control``.

A cancel must take effect wherever the request is: preprocess, route and
schedule drop a cancelled request's events, and schedule drops its parked
task, so no task for it reaches infer after the cancel (a task already sent
is infer's to stop). Every process reads every cancel (a broadcast, no
consumer group), starting the request timeout back, so a
layers process that restarts still knows the cancels of requests that can
still be in flight.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from conveyor.settings import Settings
from schemas.codec import Codec, default_codec
from topics.catalog import CONTROL
from topics.envelope import now_ms
from topics.follow import Follower, FromTime, follow

__all__ = ["CancelList"]

log = logging.getLogger(__name__)

_REMEMBER = 100_000


class CancelList:
    """Request ids cancelled lately; listeners hear of each new one."""

    def __init__(self, settings: Settings, codec: Codec | None = None) -> None:
        self.settings = settings
        self.codec = codec or default_codec()
        self.cancelled: OrderedDict[str, None] = OrderedDict()
        self._listeners: list[Callable[[str], None]] = []
        self.follower: Follower | None = None

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.cancelled

    def subscribe(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def add(self, request_id: str) -> None:
        if request_id in self.cancelled:
            return
        self.cancelled[request_id] = None
        while len(self.cancelled) > _REMEMBER:
            self.cancelled.popitem(last=False)
        for listener in self._listeners:
            listener(request_id)

    async def run(self) -> None:
        """Follow ``conveyor.control`` for ever (through broker outages)."""
        start = FromTime(now_ms() - int(self.settings.gateway.request_timeout_s * 1000))
        self.follower = follow(self.settings, CONTROL, 0, start)
        async for batch in self.follower.events(self.codec):
            for _, control in batch:
                if control["action"] == "cancel":
                    self.add(control["request_id"])
