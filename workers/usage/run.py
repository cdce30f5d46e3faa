"""Running the accounting app in the current process: ``conveyor accounting``.

:func:`run_accounting` creates the topics the app reads and writes and that
Faust does not create itself (``conveyor.usage`` and ``conveyor.dlq``, as
the catalog describes them; Faust creates its changelog topics, replicated
as the catalog's are), then runs a :class:`faust.Worker` until SIGTERM or
SIGINT, which stop it cleanly (the consumer leaves its group, the producer
is flushed). Faust's web server is off (``web_enabled=False``): nothing
listens on a port, so any number of accounting processes share a host.
Logging keeps Conveyor's format (``override_logging=False``).
"""

from __future__ import annotations

import asyncio

import faust

from conveyor.logs import setup_logging
from conveyor.metrics import LayerProbe
from conveyor.settings import Settings
from topics.admin import ensure_topics
from topics.catalog import catalog
from workers.usage.app import AccountingApp

__all__ = ["run_accounting"]


def run_accounting(settings: Settings, probe: LayerProbe | None = None) -> None:
    """Run the accounting app until it is told to stop; returns after a clean stop.
    ``probe`` counts the usage events it handled and dead-lettered (metrics)."""
    setup_logging(settings.log_level)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    needed = {settings.topic("usage"), settings.topic("dlq")}
    replication = loop.run_until_complete(
        ensure_topics(settings, [s for s in catalog(settings) if s.name in needed]))
    accounting = AccountingApp(settings, replication, probe=probe)
    worker = faust.Worker(accounting.app, loop=loop, loglevel=settings.log_level, quiet=True,
                          override_logging=False, redirect_stdouts=False)
    worker.spinner = None  # a terminal spinner would write escape codes into the log
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:  # mode ends every run with SystemExit
        if exc.code not in (0, None):
            raise
