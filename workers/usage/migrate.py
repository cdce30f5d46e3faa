"""Ratings counted by an earlier Conveyor carried into the one ratings table.

Ratings were once kept in two Faust tables, ``feedback-totals`` (rows) and
``feedback-latest`` (request id -> the rating it counted); both now live in
``feedback-ratings``, the latest ratings keyed ``LATEST + request id``
(workers/usage/ratings.py). Without this step an upgrade would drop every
earlier rating from ``/v1/usage``: the new table starts empty and the app's
commits are past those events.

:func:`carry_old_ratings` runs before Faust starts (workers/usage/run.py). When
the old totals changelog exists it reads both old changelogs to their ends
(the last record of a key wins, a tombstone deletes it), writes the rows and
then the latest ratings into the new changelog in Faust's JSON encoding,
waits for the acknowledgements, and deletes the old changelogs,
``feedback-latest``'s first: the old totals changelog means "still to do", so
a process killed before the deletes does it again. Rolling upgrades start
members one at a time (a member still copying could write an older row over
a newer one).
"""

from __future__ import annotations

import json
import logging

from aiokafka.admin import AIOKafkaAdminClient

from conveyor.settings import Settings
from topics.clients import make_producer
from topics.lookup import KeyLookup
from workers.usage.ratings import LATEST

__all__ = ["carry_old_ratings", "OLD_TOTALS", "OLD_LATEST"]

log = logging.getLogger(__name__)

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
    """Copy the two old ratings tables into ``new_table``'s changelog and delete
    them; how many records were copied (0 when there is nothing to carry)."""
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
