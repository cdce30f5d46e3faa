"""``conveyor dlq``: a poison event dead-lettered by the running pipeline is
listed and shown, refused while it still cannot be read, and sent back once a
schema upgrade makes it readable (once, unless forced).

The upgrade: the poison is a Request written with a newer schema version
(one more field) than the pipeline knows, which preprocess dead-letters as
an unknown fingerprint. The fix is that version registered as history in a
codec (``Codec.register_writer``, what adding it to ``schemas/avro/history``
does): the redrive checks the letter with that codec and the event it puts
back on the requests topic is read by it. The pipeline's own layer process
keeps the codec it started with, so it dead-letters the redriven copy again;
a running process cannot learn a schema without a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form

from cli import dlq as cli_dlq
from conveyor.settings import Settings, load_settings
from gateway import dead_letters
from schemas.codec import Codec, default_codec
from tests.support.factories import encoded_with
from tests.support.factories import request as make_request
from tests.support.pipeline import Pipeline, client
from topics.clients import make_producer
from topics.lookup import KeyLookup
from workers.outputs import dead_letter_record


def run(settings: Settings, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli_dlq.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["dlq", *argv])
    result: int = args.func(settings, args)
    return result


def newer_request_schema(tmp: Path) -> Path:
    """``conveyor.Request`` with one more field: a version this Conveyor lacks."""
    schema = json.loads(to_parsing_canonical_form(default_codec().schema("Request")))
    schema["fields"].append({"name": "hint", "type": "string"})
    path = tmp / "conveyor.Request.v99.avsc"
    path.write_text(json.dumps(schema))
    return path


async def produce(settings: Settings, key: str, value: bytes) -> None:
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(settings.kafka.topic("requests"), value, key=key.encode())
    finally:
        await producer.stop()


async def record_at(settings: Settings, where: str) -> tuple[bytes | None, bytes | None]:
    topic, rest = where.split("[", 1)
    partition, offset = rest.split("]@")
    async with KeyLookup(settings) as look:
        r = await look.at(topic, int(partition), int(offset))
    assert r is not None
    return r.key, r.value


def test_event_type_of_names_what_each_topic_carries() -> None:
    s = load_settings(topic_prefix="x")
    assert dead_letters.event_type_of(s, "x.requests") == "Request"
    assert dead_letters.event_type_of(s, "x.infer.cpu") == "Task"
    assert dead_letters.event_type_of(s, "y.requests") is None


def test_a_poison_fixed_by_a_schema_upgrade_is_redriven_once(
        pipeline: Pipeline, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = pipeline.settings
    schema_path = newer_request_schema(tmp_path)
    writer = parse_schema(json.loads(schema_path.read_text()), _write_hint=False)
    rid = uuid.uuid4().hex
    record = dict(make_request(request_id=rid)) | {"hint": "from a newer gateway"}
    poison = encoded_with(writer, record)
    asyncio.run(produce(settings, rid, poison))

    # the running preprocess dead-letters it; list finds it with its error
    letter = None
    deadline = time.monotonic() + 30
    while letter is None and time.monotonic() < deadline:
        assert run(settings, "list", "--json", "--since", "10m") == 0
        mine = [x for x in json.loads(capsys.readouterr().out) if x["key"] == rid]
        letter = mine[0] if mine else None
        if letter is None:
            time.sleep(0.5)
    assert letter is not None, "the poison did not reach the DLQ"
    assert letter["layer"] == "preprocess" and not letter["redriven"]
    assert letter["source"].startswith(settings.kafka.topic("requests") + "[")
    assert "unknown schema fingerprint" in letter["error"]
    offset = letter["offset"]

    assert run(settings, "list", "--layer", "route", "--since", "10m") == 0
    assert rid not in capsys.readouterr().out
    assert run(settings, "show", str(offset)) == 0
    shown = capsys.readouterr().out
    assert "layer    preprocess" in shown and "decodes  no" in shown
    assert "unknown schema fingerprint" in shown and "from a newer gateway" not in shown

    # not fixed yet: the redrive refuses, as the event would only come back
    assert run(settings, "redrive", str(offset)) == 1
    assert "still does not decode" in capsys.readouterr().out

    # the upgrade: a codec that knows the newer version
    upgraded = Codec()
    upgraded.register_writer(schema_path)
    letters = asyncio.run(dead_letters.read_letters(settings, 0, [offset]))
    [sent] = asyncio.run(dead_letters.redrive(settings, letters, "test", codec=upgraded))
    assert sent.sent, sent.detail
    key, value = asyncio.run(record_at(settings, sent.detail))
    assert key == rid.encode() and value == poison
    assert sent.detail.startswith(letter["source"].split("@")[0] + "@")  # same partition
    assert upgraded.decode(value, "Request")["envelope"]["request_id"] == rid

    # recorded: listed as redriven, and not sent twice without --force
    assert run(settings, "list", "--json", "--since", "10m") == 0
    listed = {x["offset"]: x for x in json.loads(capsys.readouterr().out)}
    assert listed[offset]["redriven"]
    [again] = asyncio.run(dead_letters.redrive(settings, letters, "test", codec=upgraded))
    assert not again.sent and "already redriven" in again.detail
    [forced] = asyncio.run(dead_letters.redrive(settings, letters, "test", codec=upgraded,
                                                force=True))
    assert forced.sent and forced.detail != sent.detail
    assert run(settings, "show", str(offset)) == 0
    assert "redriven " in capsys.readouterr().out


async def letter_of_its_request(settings: Settings, request_id: str) -> int:
    """A dead letter of the request's own ``conveyor.requests`` event, as a layer
    that gave up on it writes one; its offset in the DLQ."""
    codec = default_codec()
    topic = settings.kafka.topic("requests")
    async with KeyLookup(settings) as look:
        [record] = await look.find(topic, request_id, 0, first=True)
    letter = dead_letter_record(settings.kafka, "preprocess", topic, record.partition,
                                record.offset, record.key, record.value,
                                "Traceback (most recent call last):\nRuntimeError: a bug")
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        meta = await producer.send_and_wait(settings.kafka.topic("dlq"),
                                            codec.encode("DeadLetter", letter),
                                            key=request_id.encode())
    finally:
        await producer.stop()
    return int(meta.offset)


def test_a_letter_of_a_request_answered_already_is_not_sent_back_without_force(
        pipeline: Pipeline, capsys: pytest.CaptureFixture[str]) -> None:
    """A layer that gives up on a request's event fails the request (an error
    reply) as it dead-letters the event: sent back, the request would be
    answered a second time."""
    settings = pipeline.settings
    answered = client(pipeline).completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    rid = answered.id.removeprefix("cmpl-")
    offset = asyncio.run(letter_of_its_request(settings, rid))

    assert run(settings, "redrive", str(offset)) == 1
    refused = capsys.readouterr().out
    assert f"its request {rid} was answered already" in refused, refused
    assert f"{settings.kafka.topic('replies')}[" in refused
    letters = asyncio.run(dead_letters.read_letters(settings, 0, [offset]))
    [forced] = asyncio.run(dead_letters.redrive(settings, letters, "test", force=True))
    assert forced.sent, forced.detail


@pytest.mark.parametrize(("args", "env"), [
    (["dlq", "list"], {"CONVEYOR_KAFKA_BOOTSTRAP": "127.0.0.1:{port}"}),
    (["inspect", "nope"], {"CONVEYOR_KAFKA_BOOTSTRAP": "127.0.0.1:{port}"}),
    (["usage", "--tenant", "acme"], {"CONVEYOR_REDIS_URL": "redis://:s3cret@127.0.0.1:{port}/0"}),
])
def test_a_tool_run_while_its_service_is_down_says_so_without_a_traceback(
        args: list[str], env: dict[str, str]) -> None:
    import os
    import subprocess
    import sys

    from tests.support.pipeline import ROOT
    from tests.support.services import free_port

    port = free_port()  # nothing listens there
    done = subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT,
                          env={**os.environ, **{k: v.format(port=port) for k, v in env.items()}},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "cannot be reached" in done.stderr and "is it running?" in done.stderr
    assert "Traceback" not in done.stderr and "s3cret" not in done.stderr
