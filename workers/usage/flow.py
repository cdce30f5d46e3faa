"""Keep Faust from dropping the first events after a rebalance.

faust-streaming ends a rebalance by resuming the stream partitions, seeking
them to their committed offsets, then ``app.flow_control.resume()`` (which
empties every agent's queue), then ``consumer.resume_flow()``. The flow is
already on, so events fetched during the seek were cleared from the queues
while the position moved past them (docs/decisions/0002-faust-on-the-cold-path-only.md).
:func:`hold_flow_until_resumed` stops the consumer's flow on
``on_rebalance_complete`` (sent before that sequence): nothing reaches an
agent until Faust's own ``resume_flow()``, and the seek reads again what was
fetched meanwhile.

Written against faust-streaming 0.15.3 (``faust/tables/recovery.py``); the
order it relies on is pinned by tests/unit/workers/usage/test_faust_patches.py.
"""

from __future__ import annotations

from typing import Any

__all__ = ["hold_flow_until_resumed"]


def hold_flow_until_resumed(app: Any) -> None:
    """Connect the hold to ``app`` (a faust.App, before it starts)."""

    async def hold(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # Consumer.stop_flow: getmany waits for resume_flow, and what a fetch
        # returns meanwhile is not handed on but read again (perform_seek)
        app.consumer.stop_flow()

    app.on_rebalance_complete.connect(hold)
