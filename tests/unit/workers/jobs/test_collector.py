"""The results layer: job states published, output files written, commits held
until a finished job's state is out."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from conveyor.files.local import LocalFileStore
from conveyor.settings import Settings, load_settings
from topics.envelope import new_envelope
from workers.jobs.collector import CANCEL_GRACE_MS, ResultsLayer, output_file_id
from workers.outputs import Output, job_event, result_output


class Recording:
    """Takes the place of the Kafka sender: what the tick would produce."""

    def __init__(self) -> None:
        self.out: list[Output] = []

    async def produce(self, outputs: list[Output], stopping: Any = None) -> None:
        self.out.extend(outputs)


class Rec:
    def __init__(self, offset: int) -> None:
        self.topic, self.partition, self.offset = "x.results", 0, offset


def setup(tmp_path: Path) -> tuple[Settings, ResultsLayer, LocalFileStore]:
    settings = load_settings(topic_prefix="x", files_dir=tmp_path)
    files = LocalFileStore(settings.jobs)
    return settings, ResultsLayer(settings, files), files


def expanded(settings: Settings, total: int) -> Any:
    base = {"id": "batch_1", "object": "batch", "created_at": 1_700_000_000,
            "expires_at": 1_700_086_400}
    return job_event(settings, "batch_1", "expanded", json.dumps(
        {"object": base, "total": total, "tenant": "acme"})).record


def result(settings: Settings, line: int, status: int = 200) -> Any:
    envelope = new_envelope(f"batch_1-{line}", reply_gateway="", reply_partition=-1,
                            job_id="batch_1", job_item=f"c{line}")
    return result_output(settings, envelope, status_code=status,
                         body=json.dumps({"line": line}) if status == 200 else "",
                         text="x").record


def statuses(outputs: list[Output]) -> list[str]:
    return [json.loads(o.record["object"])["status"] for o in outputs]


async def test_a_finished_batch_is_published_by_the_tick_and_its_files_written(
        tmp_path: Path) -> None:
    settings, layer, files = setup(tmp_path)
    sender = Recording()
    await layer.start(sender)  # type: ignore[arg-type]
    try:
        assert statuses(await layer.handle(expanded(settings, 2), Rec(5))) == ["in_progress"]
        await layer.handle(result(settings, 1), Rec(6))
        assert await layer.handle(result(settings, 0), Rec(7)) == []  # final: the tick's
        tp = TopicPartition("x.results", 0)
        assert layer.committable(tp, 8) == 5  # held until the final state is out
        for _ in range(40):
            if sender.out:
                break
            await asyncio.sleep(0.05)
        assert statuses(sender.out) == ["completed"]
        assert layer.committable(tp, 8) == 8
        obj = json.loads(sender.out[0].record["object"])
        assert obj["output_file_id"] == output_file_id("batch_1", "output", 1_700_000_000)
        content = (await files.read("acme", obj["output_file_id"])).decode().splitlines()
        assert [json.loads(x)["custom_id"] for x in content] == ["c0", "c1"]
        assert obj["error_file_id"] is None
        # a redelivered result of a finished job is ignored
        assert await layer.handle(result(settings, 0), Rec(9)) == []
    finally:
        await layer.stop()


async def test_a_cancelled_batch_ends_once_its_requests_go_quiet(tmp_path: Path) -> None:
    settings, layer, _ = setup(tmp_path)
    await layer.handle(expanded(settings, 3), Rec(1))
    await layer.handle(result(settings, 0), Rec(2))
    cancel = job_event(settings, "batch_1", "cancel").record
    assert statuses(await layer.handle(cancel, Rec(3))) == ["cancelling"]
    outputs, finished = await layer.tick(cancel["ts_ms"] + 100)
    assert outputs == [] and finished == []
    outputs, finished = await layer.tick(cancel["ts_ms"] + CANCEL_GRACE_MS + 1)
    assert statuses(outputs) == ["cancelled"] and finished == ["batch_1"]
    assert json.loads(outputs[0].record["object"])["request_counts"] == {
        "total": 3, "completed": 1, "failed": 0}


async def test_a_batch_past_its_window_expires(tmp_path: Path) -> None:
    settings, layer, _ = setup(tmp_path)
    await layer.handle(expanded(settings, 3), Rec(1))
    await layer.handle(result(settings, 2, status=404), Rec(2))
    outputs, _ = await layer.tick(1_700_086_400 * 1000 + 1)
    obj = json.loads(outputs[0].record["object"])
    assert obj["status"] == "expired" and obj["error_file_id"] is not None


async def test_a_batch_whose_files_could_not_be_written_is_finished_by_a_later_tick(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Its last result applied, the output file failed (a full disk): the batch,
    every result in, must not wait for its expiry, nor the layer stop."""
    settings, layer, files = setup(tmp_path)
    await layer.handle(expanded(settings, 1), Rec(1))
    real_create = files.create

    async def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "create", full_disk)
    assert await layer.handle(result(settings, 0), Rec(2)) == []
    outputs, finished = await layer.tick(1_700_000_001_000)
    # the disk is still full: its progress is published, not its end
    assert statuses(outputs) == ["in_progress"] and finished == []
    monkeypatch.setattr(files, "create", real_create)
    outputs, finished = await layer.tick(1_700_000_002_000)
    assert statuses(outputs) == ["completed"] and finished == ["batch_1"]
    obj = json.loads(outputs[0].record["object"])
    content = (await files.read("acme", obj["output_file_id"])).decode()
    assert json.loads(content)["custom_id"] == "c0"
