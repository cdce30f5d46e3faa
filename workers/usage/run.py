"""``conveyor accounting``: :func:`run_accounting` creates the app's topics,
carries ratings of an earlier Conveyor into the one ratings table
(:func:`carry_old_ratings`), then runs a :class:`faust.Worker` until SIGTERM
or SIGINT (Faust's web server off)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import faust
from aiokafka.admin import AIOKafkaAdminClient

from conveyor.logs import setup_logging
from conveyor.metrics import LayerProbe
from conveyor.settings import Settings
from topics.admin import ensure_topics
from topics.catalog import TopicSpec, catalog
from topics.clients import make_producer
from topics.lookup import KeyLookup
from workers.usage.app import AccountingApp
from workers.usage.ratings import LATEST

__all__ = ["run_accounting", "changelog_specs", "carry_old_ratings", "OLD_TOTALS", "OLD_LATEST"]

log = logging.getLogger(__name__)


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
    # ratings an earlier Conveyor counted in two tables
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


OLD_TOTALS = "feedback-totals"
OLD_LATEST = "feedback-latest"
# an old changelog is read once, at the upgrade: bounded, generously (the step
# is done again at the next start when it fails)
_READ_WITHIN_S = 600.0


def _changelog(app_id: str, table: str) -> str:
    return f"{app_id}-{table}-changelog"


async def _last_values(settings: Settings, topic: str) -> dict[bytes, bytes]:
    """Key -> last value of a one-partition topic read to its end (tombstoned
    keys left out), through the keyed lookup's reader: every key, from the
    first record to the end offset seen when the read began."""
    async with KeyLookup(settings, timeout_s=_READ_WITHIN_S) as look:
        records = await look.find(topic, None, 0, partitions=[0])
    values: dict[bytes, bytes] = {}
    for record in records:
        if record.key is None:
            continue
        if record.value is None:
            values.pop(record.key, None)
        else:
            values[record.key] = record.value
    return values


async def carry_old_ratings(settings: Settings, app_id: str, new_table: str) -> int:
    """Copy the two old ratings tables (``feedback-totals`` rows and
    ``feedback-latest``, request id -> its rating) into ``new_table``'s
    changelog, the latest keyed ``LATEST + request id``, and delete them,
    ``feedback-latest`` first: the old totals changelog means "still to do",
    so a process killed before the deletes does it again. How many records
    were copied (0 when there is nothing to carry)."""
    old_totals, old_latest = _changelog(app_id, OLD_TOTALS), _changelog(app_id, OLD_LATEST)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        if old_totals not in existing:
            return 0
        rows = await _last_values(settings, old_totals)
        latest = (await _last_values(settings, old_latest)) if old_latest in existing else {}
        target = _changelog(app_id, new_table)
        producer = make_producer(settings.kafka)
        await producer.start()
        try:
            sent = [await producer.send(target, value, key=key, partition=0)
                    for key, value in rows.items()]
            # after the rows, as the table itself writes them (ratings.py)
            for key, value in latest.items():
                renamed = json.dumps(LATEST + json.loads(key)).encode()
                sent.append(await producer.send(target, value, key=renamed, partition=0))
            for fut in sent:
                await fut
        finally:
            await producer.stop()
        log.info("ratings: %d rows and %d latest ratings of the earlier two tables carried "
                 "into %s", len(rows), len(latest), target)
        gone = [t for t in (old_latest, old_totals) if t in existing]
        for topic in gone:  # the latest ratings' first: the totals say "still to do"
            await admin.delete_topics([topic])
        return len(rows) + len(latest)
    finally:
        await admin.close()
