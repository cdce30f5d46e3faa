"""Keep Faust from dropping the first events after a rebalance.

faust-streaming ends every rebalance (``Recovery.on_recovery_completed``, or
``_resume_streams`` when no table needed restoring) in this order: resume
the stream partitions, seek them to their committed offsets (an await, a
broker round trip), then ``app.flow_control.resume()``, which empties every
agent's incoming queue, then ``consumer.resume_flow()``. The consumer's flow
is already on at that point (the table recovery turned it on to read the
changelogs; on a first start nothing turned it off), so events fetched
during the seek are handed to the agent's queue, and the ones the agent has
not taken yet are thrown away by the queue's clearing, while the consumer's
position has moved past them. Nothing fetches them again until the next
rebalance. A successor started right after a SIGKILL, with the events sent
at that moment, counted nothing more (the accounting restart test failed
now and then: "fetches nothing"; docs/decisions/0002-faust-on-the-cold-path-only.md).

:func:`hold_flow_until_resumed` stops the consumer's flow when Faust
announces the end of a rebalance (``on_rebalance_complete``, sent before
that resume-seek-clear sequence): nothing is handed to an agent until
Faust's own ``resume_flow()``, after the clearing, and what was fetched
meanwhile is read again from the committed offsets by the seek.

Written against faust-streaming 0.15.3 (``faust/tables/recovery.py``); the
order it relies on (the signal before the seek and the clearing) is pinned
by tests/unit/workers/usage/test_faust_patches.py.
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
