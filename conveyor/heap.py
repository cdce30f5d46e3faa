"""The cyclic garbage collector of a serving process, set once it has started.

:func:`settle` is called by a serving command (gateway, layer, infer, accounting)
once it has started, never by library code or tests: it collects once, moves
everything alive into the permanent generation (:func:`gc.freeze`), which no
collection scans, and raises the youngest generation's threshold to
``CONVEYOR_GC_THRESHOLD`` (0 leaves the collector as Python sets it). Why, and
what full collections cost before: docs/decisions/0014-a-settled-heap.md.
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
