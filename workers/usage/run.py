"""Running the accounting app in the current process: ``conveyor accounting``.

:func:`run_accounting` creates the topics the app needs before Faust starts
(``conveyor.usage``, ``conveyor.dlq`` and the tables' changelogs), carries
ratings an earlier Conveyor counted (workers/usage/migrate.py), then runs a
:class:`faust.Worker` until SIGTERM or SIGINT stop it cleanly. Faust's web
server is off, so any number of accounting processes share a host; logging
keeps Conveyor's format.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import faust

from conveyor.logs import setup_logging
from conveyor.metrics import LayerProbe
from conveyor.settings import Settings
from topics.admin import ensure_topics
from topics.catalog import TopicSpec, catalog
from workers.usage.app import AccountingApp
from workers.usage.migrate import carry_old_ratings

__all__ = ["run_accounting", "changelog_specs"]


def changelog_specs(accounting: AccountingApp) -> list[TopicSpec]:
    """The changelog topic of each of the app's tables, compacted, with the
    partitions and configs Faust would create it with."""
    return [TopicSpec(name=table.changelog_topic_name, partitions=table.changelog_topic.partitions
                      or accounting.app.conf.topic_partitions, key="the table's row key",
                      cleanup="compact", extra=dict(table.changelog_topic.config or {}))
            for table in accounting.app.tables.values()]


def run_accounting(settings: Settings, probe: LayerProbe | None = None,
                   on_started: Callable[[], None] | None = None) -> None:
    """Run the accounting app until it is told to stop; returns after a clean stop.
    ``probe`` counts the usage events it handled and dead-lettered (metrics);
    ``on_started`` is called once the Faust worker has started its app."""
    setup_logging(settings.telemetry.log_level)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    needed = {settings.kafka.topic("usage"), settings.kafka.topic("dlq")}
    replication = loop.run_until_complete(
        ensure_topics(settings, [s for s in catalog(settings.kafka) if s.name in needed]))
    accounting = AccountingApp(settings, replication, probe=probe)
    # the tables' changelogs made here, not by Faust as it starts: Faust's consumer
    # may ask for metadata before the broker serves a topic Faust just made, and
    # then runs without it (the partitions never assigned, no table recovered, a
    # table's writes refused as having a changelog of 0 partitions)
    loop.run_until_complete(ensure_topics(settings, changelog_specs(accounting)))
    # ratings an earlier Conveyor counted in two tables (workers/usage/migrate.py)
    loop.run_until_complete(carry_old_ratings(settings, accounting.app.conf.id,
                                              accounting.rating_table.name))
    if on_started is not None:
        started = on_started

        async def call_on_started() -> None:
            started()

        accounting.app.task(call_on_started)
    worker = faust.Worker(accounting.app, loop=loop, loglevel=settings.telemetry.log_level,
                          quiet=True,
                          override_logging=False, redirect_stdouts=False)
    worker.spinner = None  # a terminal spinner would write escape codes into the log
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:  # mode ends every run with SystemExit
        if exc.code not in (0, None):
            raise
