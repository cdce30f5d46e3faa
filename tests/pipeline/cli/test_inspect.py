"""``conveyor inspect``: a finished request's journey, found in its partitions."""

from __future__ import annotations

import argparse
import json
import uuid

import httpx
import pytest

from cli import inspect as cli_inspect
from conveyor.settings import Settings
from tests.support.pipeline import Pipeline
from topics.envelope import now_ms
from topics.lookup import key_partition, parse_since
from workers.journey import LAYERS


def run(settings: Settings, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli_inspect.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["inspect", *argv])
    result: int = args.func(settings, args)
    return result


def test_parse_since_reads_durations_iso_and_epoch() -> None:
    now = 1_700_000_000_000
    assert parse_since("24h", now) == now - 24 * 3600 * 1000
    assert parse_since("90m", now) == now - 90 * 60 * 1000
    assert parse_since("1700000000000", now) == 1_700_000_000_000
    assert parse_since("2023-11-14T22:13:20", now) == 1_700_000_000_000
    with pytest.raises(ValueError):
        parse_since("yesterday", now)


def test_inspect_names_every_layer_of_a_finished_request(
        pipeline: Pipeline, capsys: pytest.CaptureFixture[str]) -> None:
    r = httpx.post(f"{pipeline.base_url}/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Say a secret word: pumpkin"}]})
    assert r.status_code == 200, r.text
    rid = r.json()["id"].removeprefix("chatcmpl-")
    settings = pipeline.settings

    assert run(settings, rid, "--json") == 0
    rep = json.loads(capsys.readouterr().out)
    for layer in LAYERS:
        assert rep["layers"][layer], f"no {layer} event: {rep['layers']}"
    steps = [s["step"] for s in rep["waterfall"]]
    assert set(LAYERS) <= set(steps) and "reply" in steps
    assert steps[0] == "gateway" and rep["waterfall"][0]["at_ms"] == 0
    assert all(s["hop_ms"] >= 0 for s in rep["waterfall"])
    assert rep["worker_id"] in ("w0", "w1") and rep["runs"][0]["worker_id"] == rep["worker_id"]
    assert rep["chunks"] >= 1 and rep["usage"]["completion_tokens"] == rep["completion_tokens"]
    usage = r.json()["usage"]
    assert rep["usage"] == {"prompt_tokens": usage["prompt_tokens"],
                            "completion_tokens": usage["completion_tokens"],
                            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}
    assert rep["dlq"] == [] and rep["errors"] == []
    assert "prompt" not in rep and "pumpkin" not in json.dumps(rep)
    # the gateway's producer put the request in its id's murmur2 partition,
    # and the lookup read that partition only
    requests = [x for x in rep["read"] if x["topic"] == settings.kafka.topic("requests")]
    assert [x["partition"] for x in requests] == [
        key_partition(rid.encode(), settings.kafka.pipeline_partitions)]
    assert rep["layers"]["gateway"][0].startswith(
        f"{settings.kafka.topic('requests')}[{requests[0]['partition']}]@")

    assert run(settings, rid, "--show-content") == 0
    text = capsys.readouterr().out
    for layer in LAYERS:
        assert f"  {layer} " in text
    assert "pumpkin" in text and "worker w" in text

    # the id says when the request was made: found even where --since points past it
    assert run(settings, rid, "--json", "--since", str(now_ms() + 60_000)) == 0
    assert json.loads(capsys.readouterr().out)["layers"]["gateway"]

    assert run(settings, uuid.uuid4().hex, "--since", "5m") == 1
    assert "no request" in capsys.readouterr().err
