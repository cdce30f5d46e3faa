"""The cyclic garbage collector of a serving process, set once it has started.

CPython's collector scans every tracked container object of a generation it
collects, and a full (generation 2) collection scans them all: the imported
modules, FastAPI's routes, aiokafka's and pydantic's classes, the registry,
about a hundred thousand objects in a Conveyor process, nearly all of which
live as long as the process. Under load full collections came every few
seconds, each stopping the event loop for tens of milliseconds (measured:
docs/decisions/0014-a-settled-heap.md).

:func:`settle` is called by a serving command (gateway, layer, infer) once it
has started, never by library code or tests: it collects once, then moves
everything alive into the permanent generation (:func:`gc.freeze`), which no
collection scans, and raises the youngest generation's threshold from 700
allocations to ``CONVEYOR_GC_THRESHOLD``, so the objects of requests in flight
(which live for tens of milliseconds) are scanned less often. Frozen objects
are still freed by reference counting; only a cycle among them outlives its
use, and what a process builds at start lives until it exits anyway.
``CONVEYOR_GC_THRESHOLD=0`` leaves the collector as Python sets it.
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
