"""How the accounting app configures Faust (workers/usage/app.py): where its
data directory goes and how soon a dead member leaves the group. Nothing
here starts the app."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from conveyor.settings import load_settings
from topics.admin import Replication
from workers.usage.app import AccountingApp, accounting_datadir, conveyor_home
from workers.usage.flow import FETCH_MAX_WAIT_MS, FETCH_MIN_BYTES


def test_the_home_is_conveyor_home_else_dot_conveyor_in_the_current_directory() -> None:
    assert conveyor_home({"CONVEYOR_HOME": "/srv/conveyor"}) == Path("/srv/conveyor")
    assert conveyor_home({}) == Path.cwd() / ".conveyor"
    assert conveyor_home({"CONVEYOR_HOME": ""}) == Path.cwd() / ".conveyor"
    assert conveyor_home({"CONVEYOR_HOME": "rel"}) == Path.cwd() / "rel"


def test_faust_keeps_its_data_directory_under_the_home(tmp_path: Path) -> None:
    accounting = AccountingApp(load_settings(topic_prefix="tdata"), Replication(1, 1, 1),
                               home=tmp_path)
    expected = tmp_path / "accounting" / "tdata.accounting"
    assert accounting.datadir == expected == accounting_datadir(tmp_path, "tdata.accounting")
    assert accounting.app.conf.datadir == expected
    assert accounting.app.conf.tabledir.is_relative_to(expected)
    # Faust makes the directory itself, with no parents: they are there
    assert expected.parent.is_dir()


def test_a_dead_member_leaves_the_group_at_the_settings_session_timeout(
        tmp_path: Path) -> None:
    """Faust's own 60 s would keep a SIGKILLed member's partitions from its
    successor for a minute."""
    settings = load_settings(topic_prefix="tsession", consumer_session_timeout_ms=3000,
                        consumer_heartbeat_interval_ms=500)
    conf = AccountingApp(settings, Replication(1, 1, 1), home=tmp_path).app.conf
    assert conf.broker_session_timeout == 3.0
    assert conf.broker_heartbeat_interval == 0.5
    assert conf.consumer_group_instance_id is None  # dynamic membership (see the app)


def test_the_worker_consumer_lets_the_broker_batch_its_fetches(tmp_path: Path) -> None:
    """Faust leaves fetch_min_bytes at 1: a fetch a usage event (workers/usage/flow.py)."""
    accounting = AccountingApp(load_settings(topic_prefix="tfetch"), Replication(1, 1, 1),
                               home=tmp_path)

    async def made() -> tuple[int, int, str]:
        thread = cast(Any, accounting.app.consumer)._thread
        consumer = thread._create_worker_consumer(accounting.app.transport)
        try:
            return consumer._fetch_min_bytes, consumer._fetch_max_wait_ms, consumer._group_id
        finally:
            await consumer.stop()

    # Faust's own settings (the group) kept
    assert asyncio.run(made()) == (FETCH_MIN_BYTES, FETCH_MAX_WAIT_MS, "tfetch.accounting")
    # after a rebalance the counted topics' partitions with no commit are read from
    # their beginning (tests/kafka/workers/usage/test_usage_fetching.py), not Faust's
    # own topics or the tables' changelogs
    assert cast(Any, accounting.app.transport).counted_topics == {"tfetch.usage",
                                                                  "tfetch.feedback"}
