"""``conveyor replay``: a finished request run again through fresh layers
reproduces what the pipeline recorded, and a dead letter fails again.

Compared, field by field after flattening: everything in the outputs but
``envelope.stamps`` (the replay's clock), ``envelope.attempt`` and
``envelope.reply_partition`` (blanked by the replay). For preprocess that
is the Prepared event's generation (messages, sampling, model), its prompt
(text, tokens, exactness, max_tokens, dropped messages, fingerprint) and the
rest of its envelope (request id, tenant, trace context, reply gateway,
deadline, priority); for route the same plus the Task's route.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

import httpx
import pytest

from cli import replay as cli_replay
from conveyor.settings import Settings
from gateway.dead_letters import read_letters
from tests.pipeline.cli.test_dlq import newer_request_schema, produce
from tests.support.factories import encoded_with
from tests.support.factories import request as make_request
from tests.support.pipeline import Pipeline


def run(settings: Settings, capsys: pytest.CaptureFixture[str], *argv: str
        ) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    cli_replay.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["replay", *argv])
    code: int = args.func(settings, args)
    out = capsys.readouterr()
    return code, out.out, out.err


def _layer(rep: dict[str, Any], name: str) -> dict[str, Any]:
    return next(x for x in rep["layers"] if x["layer"] == name)


def test_a_finished_request_replays_to_its_recorded_outputs(
        pipeline: Pipeline, capsys: pytest.CaptureFixture[str]) -> None:
    r = httpx.post(f"{pipeline.base_url}/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "max_tokens": 3,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Name a fruit: mango"}]})
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("chatcmpl-")
    settings = pipeline.settings

    code, out, err = run(settings, capsys, rid, "--through", "preprocess", "--json",
                         "--show-content")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["same"] and rep["scratch_prefix"].startswith("replay")
    assert rep["ignored"] == ["envelope.stamps", "envelope.attempt", "envelope.reply_partition"]
    pre = _layer(rep, "preprocess")
    assert pre["inputs"][0].startswith(settings.kafka.topic("requests") + "[")
    assert pre["error"] == {"recorded": None, "replayed": None, "same": True}
    [pair] = pre["outputs"]
    assert pair["same"] and pair["differ"] == []
    assert pair["recorded_at"].startswith(settings.kafka.topic("prepared") + "[")
    recorded, replayed = pair["recorded"], pair["replayed"]
    for f in ("text", "tokens", "fingerprint", "max_tokens", "exact"):
        assert replayed["prompt"][f] == recorded["prompt"][f], f
    assert replayed["prompt"]["tokens"] == r.json()["usage"]["prompt_tokens"]
    assert replayed["generation"] == recorded["generation"]
    # what is not compared does differ: a new stamp, and no reply address
    assert replayed["envelope"]["reply_partition"] == -1
    assert recorded["envelope"]["reply_partition"] >= 0
    assert replayed["envelope"]["stamps"]["preprocess"] > recorded["envelope"]["stamps"][
        "preprocess"]

    code, out, err = run(settings, capsys, rid, "--through", "preprocess,route", "--json")
    assert code == 0, err
    rep = json.loads(out)
    route = _layer(rep, "route")
    assert rep["same"] and route["inputs"] == ["replayed preprocess"]
    assert route["outputs"][0]["same"]
    assert route["outputs"][0]["recorded_at"].startswith(settings.kafka.topic("routed") + "[")
    assert "mango" not in out  # no content without --show-content

    code, out, _ = run(settings, capsys, rid, "--through", "preprocess,route")
    assert code == 0
    assert "preprocess: same" in out and "route: same" in out and "mango" not in out

    code, out, err = run(settings, capsys, rid, "--through", "postprocess", "--json")
    assert code == 0, err
    post = _layer(json.loads(out), "postprocess")
    assert post["inputs"][0].startswith(settings.kafka.topic("tokens") + "[")
    assert post["recorded_outputs"] == post["replayed_outputs"] >= 1
    assert post["same"], json.dumps(post, indent=1)
    assert post["outputs"][-1]["recorded_at"].startswith(settings.kafka.topic("replies") + "[")

    code, _, err = run(settings, capsys, rid, "--through", "schedule")
    assert code == 2 and "worker partition" in err
    code, _, err = run(settings, capsys, uuid.uuid4().hex, "--since", "5m")
    assert code == 1 and "no request" in err


def test_a_dead_letter_replayed_fails_in_its_layer_again(
        pipeline: Pipeline, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from fastavro import parse_schema

    settings = pipeline.settings
    schema = json.loads(newer_request_schema(tmp_path).read_text())
    rid = uuid.uuid4().hex
    record = dict(make_request(request_id=rid)) | {"hint": "from a newer gateway"}
    poison = encoded_with(parse_schema(schema, _write_hint=False), record)
    asyncio.run(produce(settings, rid, poison))

    letter = None
    deadline = time.monotonic() + 30
    while letter is None and time.monotonic() < deadline:
        found = asyncio.run(read_letters(settings, int(time.time() * 1000) - 60_000))
        letter = next((x for x in found if x.letter["key"] == rid.encode()), None)
        if letter is None:
            time.sleep(0.5)
    assert letter is not None, "the poison did not reach the DLQ"

    code, out, err = run(settings, capsys, rid, "--from-dlq", str(letter.offset), "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["source"] == f"dlq@{letter.offset}"
    pre = _layer(rep, "preprocess")
    assert "unknown schema fingerprint" in pre["error"]["recorded"]
    assert "unknown schema fingerprint" in pre["error"]["replayed"]
    assert pre["error"]["same"] and pre["outputs"] == [] and rep["same"]

    code, _, err = run(settings, capsys, "another-request", "--from-dlq", str(letter.offset))
    assert code == 2 and f"is of request {rid}" in err
