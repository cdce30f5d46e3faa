"""The cyclic garbage collector of a serving process, set once it has started:
:func:`settle` (called by serving commands only, never by library code or
tests) freezes what start-up built and raises the youngest generation's
threshold. Why: docs/decisions/0014-a-settled-heap.md.
"""

from __future__ import annotations

import gc
import logging

__all__ = ["settle"]

log = logging.getLogger("conveyor.heap")


def settle(threshold: int, what: str) -> None:
    """Freeze what ``what`` built while starting and set the youngest
    generation's threshold (0: leave the collector alone)."""
    if threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(threshold, older, oldest)
    log.info("%s: %d objects frozen out of the collector's way; it collects after %d "
             "allocations", what, gc.get_freeze_count(), threshold)
