"""Keep Faust from dropping the first events after a rebalance, and from
ending a rebalance in the middle of the next one.

**The hold.** faust-streaming ends a rebalance by resuming the stream
partitions, seeking them to their committed offsets, then
``app.flow_control.resume()`` (which empties every agent's queue), then
``consumer.resume_flow()``. The flow is already on, so events fetched during
the seek were cleared from the queues while the position moved past them
(docs/decisions/0002-faust-on-the-cold-path-only.md). :func:`hold_flow_until_resumed`
stops the consumer's flow on ``on_rebalance_complete`` (sent before that
sequence): nothing reaches an agent until Faust's own ``resume_flow()``, and
the seek reads again what was fetched meanwhile.

**An end in the middle of the next rebalance.** Faust ends a generation's
recovery unless the consumer's generation has changed, and the generation
changes when the next assignment arrives, not when its revocation begins: a
recovery that ended between the two (the join between them waits for every
member the group still counts, a dead one up to its session's end) resumed
the partitions, both flows and the rebalance's end there. The next assignment
then made every partition it assigned fetchable before pausing them, so a
record could reach the agents before that generation's tables were restored;
of a partition the process never held, it reached Faust's conductor before
its index knew the partition (a KeyError, and the app crashed). The hold now
also raises Faust's own ``RebalanceAgain`` when a rebalance began
(``App.rebalancing_count``, counted as aiokafka revokes) after the last
assignment: Faust's recovery loop drops that ending as it does when an
assignment interrupts a recovery, and the next assignment's recovery resumes
everything. Reproduced by tests/faults/workers/usage/test_ratings_rebalance.py.

Written against faust-streaming 0.15.3 (``faust/tables/recovery.py``,
``faust/app/base.py``); the order it relies on is pinned by
tests/unit/workers/usage/test_faust_patches.py.
"""

from __future__ import annotations

import logging
from typing import Any

from faust.tables.recovery import RebalanceAgain

__all__ = ["hold_flow_until_resumed"]

log = logging.getLogger(__name__)


class _Hold:
    """The receivers of one app's signals: the rebalance count as of the last
    assignment, and the hold."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.assigned_at: int = app.rebalancing_count

    async def on_assigned(self, sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # sent at the end of App._on_partitions_assigned, after the tables'
        # on_rebalance started that generation's recovery
        self.assigned_at = self.app.rebalancing_count

    async def on_complete(self, sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # Consumer.stop_flow: getmany waits for resume_flow, and what a fetch
        # returns meanwhile is not handed on but read again (perform_seek)
        self.app.consumer.stop_flow()
        if self.app.rebalancing_count != self.assigned_at:
            log.info("accounting: a rebalance began before the last one's recovery ended; "
                     "the next assignment's recovery resumes the partitions")
            # caught by Recovery._restart_recovery, which waits for that assignment
            raise RebalanceAgain()


def hold_flow_until_resumed(app: Any) -> None:
    """Connect the hold to ``app`` (a faust.App, before it starts)."""
    hold = _Hold(app)
    app.on_partitions_assigned.connect(hold.on_assigned)
    app.on_rebalance_complete.connect(hold.on_complete)
