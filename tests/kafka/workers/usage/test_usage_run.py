"""Starting the accounting app (workers/usage/run.py) on the real broker: its
tables' changelog topics exist, served with a leader for every partition, before
Faust starts. When Faust made them itself as it started, its consumer could ask
for metadata before the broker served them and run without them: the totals'
partitions never assigned (no recovery after a crash) and every rating refused
("the changelog topic has 0 partitions"), until a metadata refresh minutes later."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import faust
import pytest

from conveyor.settings import load_settings
from tests.kafka.topics.test_admin import _describe
from tests.support.pipeline import drop_topics
from workers.usage import run


def test_the_changelogs_are_served_before_faust_starts(
        services: None, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    app_id = settings.kafka.group("accounting")
    wanted = {f"{app_id}-usage-totals-changelog": settings.kafka.pipeline_partitions,
              f"{app_id}-feedback-ratings-changelog": 1}
    seen: list[Any] = []

    class Worker:
        """Stands where faust.Worker would run: looks at the broker instead."""

        def __init__(self, app: faust.App, **kwargs: Any) -> None:
            self.app = app

        def execute_from_commandline(self) -> None:
            seen.extend(asyncio.run(_describe(settings, list(wanted))))

    monkeypatch.setattr(run.faust, "Worker", Worker)
    # pytest owns the logging: the app's repeat filter, put on pytest's handlers,
    # would hold back the repeated errors later tests of this process look for
    monkeypatch.setattr(run, "setup_logging", lambda level: None)
    try:
        run.run_accounting(settings)
        configs, served = seen
        for name, partitions in wanted.items():
            assert len(served[name]) == partitions, served
            assert all(p["leader"] >= 0 for p in served[name]), served
            assert configs[name]["cleanup.policy"] == "compact", configs
    finally:
        drop_topics(settings.kafka.bootstrap, settings.kafka.topic_prefix)
