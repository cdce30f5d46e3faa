"""A job command the jobs layer cannot read ends its job instead of leaving it
``validating`` for ever: the record stays in ``conveyor.dlq`` and the batch
(or background response) it is keyed by ends ``failed`` with OpenAI's errors
list. Through a real pipeline and the official ``openai`` client; the rules
of the folds and of the decision without one.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from conveyor.settings import load_settings
from schemas.codec import default_codec
from schemas.records import DeadLetter, JobResult, JobStatus
from tests.support.factories import encoded_with
from tests.support.pipeline import Pipeline
from workers.jobs.dead_commands import DEAD_COMMANDS_GROUP, failure_event
from workers.jobs.folds import BatchFold, ResponseFold
from workers.outputs import job_event

TENANT = "default"  # the tenant of an unauthenticated gateway


# -- the folds and the decision -----------------------------------------------------

def _event(kind: str, **detail: Any) -> JobResult:
    record: JobResult = job_event(load_settings(topic_prefix="x"), "batch_1", kind,
                                  json.dumps(detail)).record
    return record


def _letter(value: bytes | None, key: bytes | None = b"batch_1", layer: str = "jobs",
            topic: str = "x.jobs", error: str = "SchemaError: not an Avro value") -> DeadLetter:
    return DeadLetter(layer=layer, topic=topic, partition=0, offset=7, key=key, value=value,
                      error=error, ts_ms=1)


def _status(state: str, kind: str = "batch", job_id: str = "batch_1") -> JobStatus:
    return JobStatus(job_id=job_id, kind=kind, tenant="acme", version=0, ts_ms=1,  # type: ignore[typeddict-item]
                     object=json.dumps({"id": job_id, "status": state, "endpoint": "/v1/x"}))


def test_a_rejected_command_fails_a_batch_that_is_still_validating() -> None:
    settings = load_settings(topic_prefix="x")
    out = failure_event(settings, default_codec(), _letter(b"\x00junk"), _status("validating"))
    assert out is not None and out.key == "batch_1" and out.topic == "x.results"
    fold = BatchFold("batch_1")
    assert fold.apply(out.record)
    shown = fold.object()
    assert shown["status"] == "failed" and shown["failed_at"] is not None
    assert shown["endpoint"] == "/v1/x"  # the batch as the gateway created it
    assert fold.tenant == "acme"
    [error] = shown["errors"]["data"]
    assert error["code"] == "invalid_command"
    assert (error["line"], error["param"]) == (None, None)
    assert "not an Avro single-object encoded value" in error["message"]


def test_a_command_that_decodes_but_failed_is_named_so() -> None:
    settings = load_settings(topic_prefix="x")
    good = default_codec().encode("JobCommand", {
        "job_id": "batch_1", "kind": "batch", "action": "create", "tenant": "acme",
        "key_id": "", "ts_ms": 1, "input_file_id": "f", "endpoint": "/v1/chat/completions",
        "completion_window": "24h", "metadata": {}, "generation": None, "models": [],
        "body": ""})
    out = failure_event(settings, default_codec(),
                        _letter(good, error="Traceback...\nOSError: disk full"),
                        _status("validating"))
    assert out is not None
    error = json.loads(out.record["detail"])["errors"][0]
    assert error["code"] == "command_failed" and "OSError: disk full" in error["message"]


@pytest.mark.parametrize("state", ["in_progress", "cancelling", "completed", "failed"])
def test_a_job_past_validating_is_left_alone(state: str) -> None:
    """A running batch keeps its answers: only a command never carried out fails it."""
    settings = load_settings(topic_prefix="x")
    assert failure_event(settings, default_codec(), _letter(b"x"), _status(state)) is None


def test_the_dead_letter_alone_when_the_key_names_no_job() -> None:
    settings = load_settings(topic_prefix="x")
    codec = default_codec()
    assert failure_event(settings, codec, _letter(b"x", key=None), _status("validating")) is None
    assert failure_event(settings, codec, _letter(b"x"), None) is None  # no job the board knows
    other = _status("validating", job_id="batch_2")  # a status of another job
    assert failure_event(settings, codec, _letter(b"x"), other) is None
    assert failure_event(settings, codec, _letter(b"x", layer="route"),
                         _status("validating")) is None
    assert failure_event(settings, codec, _letter(b"x", topic="x.results"),
                         _status("validating")) is None


def test_a_background_response_fails_with_the_error_when_queued() -> None:
    settings = load_settings(topic_prefix="x")
    status = _status("queued", kind="response", job_id="resp_1")
    out = failure_event(settings, default_codec(), _letter(b"junk", key=b"resp_1"), status)
    assert out is not None
    fold = ResponseFold("resp_1")
    assert fold.apply(out.record)
    shown = fold.object()
    assert shown["status"] == "failed"
    assert shown["error"]["code"] == "invalid_command"


def test_invalid_after_expanded_does_not_fail_a_running_batch() -> None:
    """The events of a job are in order: an ``invalid`` after ``expanded`` (a
    command that failed after the batch was expanded, or a create handled
    twice) leaves the batch running."""
    fold = BatchFold("batch_1")
    fold.apply(_event("expanded", object={"id": "batch_1"}, total=2, tenant="acme"))
    assert not fold.apply(_event("invalid", object={"id": "batch_1"}, tenant="acme",
                                 errors=[{"code": "invalid_command"}]))
    assert fold.status == "in_progress" and fold.errors is None
    response = ResponseFold("resp_1")
    response.apply(_event("expanded", object={"id": "resp_1"}, total=1, tenant="acme"))
    assert not response.apply(_event("invalid", errors=[{"code": "invalid_command"}]))
    assert response.status == "in_progress"


# -- through a real pipeline ------------------------------------------------------------

@pytest.fixture(scope="module")
def conveyor(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    files = tmp_path_factory.mktemp("files")
    p = Pipeline(tmp_path_factory.mktemp("logs"), CONVEYOR_FILES_DIR=str(files))
    try:
        p.start(workers=1, contexts=2)
        yield p
    finally:
        p.close()


def _client(p: Pipeline) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{p.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _line(custom_id: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2", "max_tokens": 4, "temperature": 0,
                     "messages": [{"role": "user", "content": "Say hi."}]}}


def _upload(c: openai.OpenAI, n: int) -> str:
    data = "\n".join(json.dumps(_line(f"c-{i}")) for i in range(n)) + "\n"
    return c.files.create(file=("in.jsonl", io.BytesIO(data.encode())), purpose="batch").id


def _batch_object(batch_id: str, file_id: str) -> dict[str, Any]:
    """The Batch as the gateway writes it first (gateway/jobs/batches.py)."""
    created = int(time.time())
    return {"id": batch_id, "object": "batch", "endpoint": "/v1/chat/completions",
            "errors": None, "input_file_id": file_id, "completion_window": "24h",
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": created, "in_progress_at": None, "expires_at": created + 86400,
            "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": {"suite": "undecodable"}}


def _newer_schema_command(batch_id: str) -> bytes:
    """A JobCommand written with a schema this Conveyor does not know (a field
    added by a newer gateway): a fingerprint no reader here has."""
    codec = default_codec()
    schema = json.loads(json.dumps(codec.schema("JobCommand")))
    schema["fields"].append({"name": "priority_hint", "type": "int", "default": 0})
    schema.pop("__fastavro_parsed", None)
    schema.pop("__named_schemas", None)
    from fastavro import parse_schema

    return encoded_with(parse_schema(schema), {
        "job_id": batch_id, "kind": "batch", "action": "create", "tenant": TENANT,
        "key_id": "", "ts_ms": int(time.time() * 1000), "input_file_id": "file-x",
        "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {},
        "generation": None, "models": [], "body": "", "priority_hint": 3})


async def _write(p: Pipeline, records: list[tuple[str, bytes | None, bytes]]) -> None:
    """Produce ``(topic name, key, value)`` in order, each acknowledged."""
    producer = AIOKafkaProducer(bootstrap_servers=p.settings.kafka.bootstrap)
    await producer.start()
    try:
        for name, key, value in records:
            await producer.send_and_wait(p.settings.kafka.topic(name), value, key=key)
    finally:
        await producer.stop()


def _write_status_and_command(p: Pipeline, obj: dict[str, Any], *values: bytes) -> None:
    """What the gateway writes for a new batch (its first state, version 0),
    followed by command values (undecodable ones here) keyed by the batch id."""
    status = JobStatus(job_id=obj["id"], kind="batch", tenant=TENANT, version=0,
                       ts_ms=int(time.time() * 1000), object=json.dumps(obj))
    key = obj["id"].encode()
    asyncio.run(_write(p, [("job-status", key, default_codec().encode("JobStatus", status)),
                           *[("jobs", key, v) for v in values]]))


def _until_final(c: openai.OpenAI, batch_id: str, within: float = 60.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired") or \
                time.monotonic() > deadline:
            return batch
        time.sleep(0.2)


def _letters(p: Pipeline) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = json.loads(p.cli("dlq", "list", "--layer", "jobs", "--json"))
    return out


async def _dlq_done(p: Pipeline) -> int:
    """The next DLQ offset the jobs layer's dead-command follower has committed
    (-1 before its first commit)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=p.settings.kafka.bootstrap,
                                group_id=p.settings.kafka.group(DEAD_COMMANDS_GROUP),
                                enable_auto_commit=False)
    await consumer.start()
    try:
        committed = await consumer.committed(TopicPartition(p.settings.kafka.topic("dlq"), 0))
        return -1 if committed is None else committed
    finally:
        await consumer.stop()


def _until_letters_handled(p: Pipeline, within: float = 60.0) -> list[dict[str, Any]]:
    """The jobs layer's letters, once the follower has committed past every one."""
    deadline = time.monotonic() + within
    while True:
        letters = _letters(p)
        if letters and asyncio.run(_dlq_done(p)) > max(x["offset"] for x in letters):
            return letters
        assert time.monotonic() < deadline, f"letters not handled: {letters}"
        time.sleep(0.3)


def _results_of(p: Pipeline, job_id: str) -> list[JobResult]:
    async def read() -> list[JobResult]:
        consumer = AIOKafkaConsumer(bootstrap_servers=p.settings.kafka.bootstrap,
                                    enable_auto_commit=False)
        await consumer.start()
        topic = p.settings.kafka.topic("results")
        found: list[JobResult] = []
        try:
            tps = [TopicPartition(topic, n) for n in range(p.settings.kafka.pipeline_partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(
                    [await consumer.position(tp) < ends[tp] for tp in tps]):
                for records in (await consumer.getmany(timeout_ms=300)).values():
                    found += [default_codec().decode(r.value, "JobResult") for r in records
                              if r.key == job_id.encode()]
        finally:
            await consumer.stop()
        return found

    return asyncio.run(read())




@pytest.mark.parametrize("kind", ["bad bytes", "newer schema"])
def test_an_undecodable_create_fails_its_batch_and_stays_in_the_dlq(
        conveyor: Pipeline, kind: str) -> None:
    c = _client(conveyor)
    batch_id = f"batch_{uuid.uuid4().hex}"
    obj = _batch_object(batch_id, _upload(c, 2))
    value = b"\x00not a command" if kind == "bad bytes" else _newer_schema_command(batch_id)
    _write_status_and_command(conveyor, obj, value)
    # the status is there at once; the jobs layer may have failed it already
    assert c.batches.retrieve(batch_id).status in ("validating", "failed")
    done = _until_final(c, batch_id)
    assert done.status == "failed", done
    assert done.failed_at is not None and done.metadata == {"suite": "undecodable"}
    assert done.endpoint == "/v1/chat/completions" and done.input_file_id == obj["input_file_id"]
    assert done.errors is not None and done.errors.object == "list"
    [error] = done.errors.data
    assert error.code == "invalid_command" and error.line is None and error.param is None
    assert error.message
    letters = [x for x in _letters(conveyor) if x["key"] == batch_id]
    assert len(letters) == 1 and "SchemaError" in letters[0]["error"], letters
    assert letters[0]["source"].startswith(conveyor.settings.kafka.topic("jobs"))


def test_a_redelivered_undecodable_command_fails_its_batch_once(conveyor: Pipeline) -> None:
    """The layer may read a record twice (a crash before its commit): the
    second dead letter changes nothing."""
    c = _client(conveyor)
    batch_id = f"batch_{uuid.uuid4().hex}"
    obj = _batch_object(batch_id, _upload(c, 2))
    _write_status_and_command(conveyor, obj, b"\x00twice", b"\x00twice")
    first = _until_final(c, batch_id)
    assert first.status == "failed", first
    letters = [x for x in _until_letters_handled(conveyor) if x["key"] == batch_id]
    assert len(letters) == 2, letters
    time.sleep(1.0)  # the collector's tick publishes within half a second
    again = c.batches.retrieve(batch_id)
    assert again.model_dump() == first.model_dump()
    assert again.errors is not None and len(again.errors.data) == 1
    invalid = [r for r in _results_of(conveyor, batch_id) if r["event"] == "invalid"]
    assert 1 <= len(invalid) <= 2, invalid


def test_a_letter_without_a_job_is_only_a_dead_letter_and_nothing_in_flight_is_lost(
        conveyor: Pipeline) -> None:
    """Undecodable records without a key, keyed by no known job, and keyed by a
    batch already running: each is a dead letter; the running batch completes
    with every line answered."""
    c = _client(conveyor)
    running = c.batches.create(input_file_id=_upload(c, 4), endpoint="/v1/chat/completions",
                               completion_window="24h")
    deadline = time.monotonic() + 60
    while c.batches.retrieve(running.id).status == "validating":
        assert time.monotonic() < deadline, "the batch was never expanded"
        time.sleep(0.1)
    stranger = f"batch_{uuid.uuid4().hex}"
    asyncio.run(_write(conveyor, [("jobs", None, b"\x00no key"),
                                  ("jobs", stranger.encode(), b"\x00no such job"),
                                  ("jobs", running.id.encode(), b"\x00late garbage")]))
    done = _until_final(c, running.id, within=120)
    assert done.status == "completed" and done.errors is None, done
    assert done.request_counts is not None and done.request_counts.completed == 4, done
    letters = _until_letters_handled(conveyor)
    keys = [x["key"] for x in letters]
    assert "" in keys and stranger in keys and running.id in keys, letters
    assert _results_of(conveyor, stranger) == []
    assert not [r for r in _results_of(conveyor, running.id) if r["event"] == "invalid"]


def test_a_command_of_an_ended_job_is_not_redriven(conveyor: Pipeline) -> None:
    """A create command set aside for a batch that has since failed decodes now (a
    fixed bug): sent back, its lines would run while the batch shows failed."""
    from gateway.dead_letters import read_letters, redrive
    from schemas.records import JobCommand

    c = _client(conveyor)
    batch_id = f"batch_{uuid.uuid4().hex}"
    obj = _batch_object(batch_id, _upload(c, 2))
    _write_status_and_command(conveyor, obj, b"\x00ended")
    assert _until_final(c, batch_id).status == "failed"
    command = JobCommand(job_id=batch_id, kind="batch", action="create", tenant=TENANT,
                         key_id="", ts_ms=int(time.time() * 1000),
                         input_file_id=obj["input_file_id"],
                         endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={}, generation=None, models=[], body="")
    [letter] = [x for x in _letters(conveyor) if x["key"] == batch_id]
    partition, offset = re.fullmatch(r".*\[(\d+)\]@(\d+)", letter["source"]).groups()  # type: ignore[union-attr]
    fixed = DeadLetter(layer="jobs", topic=conveyor.settings.kafka.topic("jobs"),
                       partition=int(partition), offset=int(offset),
                       key=batch_id.encode(), value=default_codec().encode("JobCommand", command),
                       error="SchemaError: since fixed", ts_ms=int(time.time() * 1000))
    asyncio.run(_write(conveyor, [("dlq", batch_id.encode(),
                                   default_codec().encode("DeadLetter", fixed))]))
    [again] = [x for x in _letters(conveyor)
               if x["key"] == batch_id and x["error"] == "SchemaError: since fixed"]

    async def send_back(force: bool) -> str:
        letters = await read_letters(conveyor.settings, 0, [again["offset"]])
        [result] = await redrive(conveyor.settings, letters, "test", force=force)
        assert result.sent == force, result
        return result.detail

    refused = asyncio.run(send_back(False))
    assert f"its job {batch_id} has ended (failed)" in refused
    asyncio.run(send_back(True))  # --force: the operator's call
