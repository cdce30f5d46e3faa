"""``conveyor groups`` through the command line's entry point, while a real
layer consumes: each group with its state, members and partitions, as text
and as JSON; with Kafka down, the command line's own message."""

from __future__ import annotations

import asyncio
import json
from unittest import mock

import pytest

from cli import main as cli_main
from conveyor.settings import Settings
from tests.kafka.topics.test_groups import (
    closed_port,
    fresh_settings,
    group_until,
    running,
    send,
)


@pytest.fixture
async def settings(services: None) -> Settings:
    return await fresh_settings()


async def conveyor(settings: Settings, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``conveyor ARGV`` against ``settings``' Kafka and prefix (on a thread: the
    command runs a loop of its own)."""
    monkeypatch.setenv("CONVEYOR_TOPIC_PREFIX", settings.kafka.topic_prefix)
    monkeypatch.setenv("CONVEYOR_KAFKA_BOOTSTRAP", settings.kafka.bootstrap)
    with mock.patch.object(cli_main, "_setup_logging"):  # pytest owns the logging
        code = await asyncio.to_thread(cli_main.main, list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


async def test_groups_prints_each_group_with_its_partitions(
        settings: Settings, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = await conveyor(settings, monkeypatch, capsys, "groups")
    assert code == 0 and out.strip() == f"no consumer group of the prefix " \
                                        f"{settings.kafka.topic_prefix}"
    await send(settings, 4)
    async with running(settings):
        await group_until(settings, "preprocess", lambda g: g.state == "Stable" and g.lag == 0
                          and sum(p.committed or 0 for p in g.partitions) == 4)
        code, out, err = await conveyor(settings, monkeypatch, capsys, "groups", "--json")
        assert code == 0, err
        [group] = json.loads(out)
        assert group["group"] == settings.kafka.group("preprocess")
        assert group["layer"] == "preprocess" and group["state"] == "Stable"
        assert group["lag"] == 0 and len(group["members"]) == 1
        requests = settings.kafka.topic("requests")
        assert [(p["topic"], p["partition"]) for p in group["partitions"]] == [
            (requests, i) for i in range(settings.kafka.pipeline_partitions)]
        assert sum(p["end"] for p in group["partitions"]) == 4
        assert {p["member"] for p in group["partitions"]} == set(group["members"])

        code, out, err = await conveyor(settings, monkeypatch, capsys, "groups")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == f"preprocess  {settings.kafka.group('preprocess')}  Stable  lag 0"
        assert lines[1] == f"  members: {group['members'][0]}"
        assert lines[2].split() == ["TOPIC", "PART", "COMMITTED", "END", "LAG", "MEMBER"]
        assert [line.split()[:2] for line in lines[3:]] == [
            [requests, str(i)] for i in range(settings.kafka.pipeline_partitions)]


async def test_groups_with_kafka_down_says_so(
        settings: Settings, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    down = settings.replace(kafka_bootstrap=f"127.0.0.1:{closed_port()}")
    code, out, err = await conveyor(down, monkeypatch, capsys, "groups")
    assert code == 3 and out == ""
    assert f"Kafka at {down.kafka.bootstrap} cannot be reached" in err
