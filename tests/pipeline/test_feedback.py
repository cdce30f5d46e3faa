"""POST /v1/feedback through a real Conveyor with API keys: a tenant rates its
own answer (by any id the answer gave it) and the rating is on
conveyor.feedback with what answered it; another tenant cannot rate it (404,
as if it did not exist); a score out of range is a 400 naming it."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from schemas.codec import default_codec
from schemas.records import Feedback
from tests.support.auth import Replicas, start_replicas
from tests.support.key_backends import read_topic
from tests.unit.workers.usage.test_usage_ratings import rating
from workers.usage.ratings import LATEST, Ratings


@pytest.fixture(scope="module")
def replicas(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    r = start_replicas(tmp_path_factory.mktemp("feedback-logs"))
    try:
        yield r
    finally:
        r.p.close()


def post(r: Replicas, secret: str, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{r.urls[0]}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {secret}"})


def ratings(r: Replicas, request_id: str) -> list[Feedback]:
    codec = default_codec()
    values = asyncio.run(read_topic(r.p.settings, "feedback"))
    return [f for f in (codec.decode(v, "Feedback") for _, v in values)
            if f["request_id"] == request_id]


def test_a_tenant_rates_its_own_answer_and_no_other(replicas: Replicas) -> None:
    _, mine = replicas.key()
    _, theirs = replicas.key()
    answer = post(replicas, mine, "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 200, answer.text
    completion_id = answer.json()["id"]
    rid = completion_id.removeprefix("chatcmpl-")

    refused = post(replicas, theirs, "/v1/feedback", {"request_id": completion_id, "score": 1})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "request_id"
    wrong = post(replicas, mine, "/v1/feedback", {"request_id": completion_id, "score": 2})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "score", wrong.text
    unknown = post(replicas, mine, "/v1/feedback", {"request_id": "nope", "score": 1})
    assert unknown.status_code == 404

    rated = post(replicas, mine, "/v1/feedback", {
        "request_id": completion_id, "score": -0.5, "labels": ["too short"],
        "comment": "It stopped early."})
    assert rated.status_code == 200, rated.text
    body = rated.json()
    assert body["object"] == "feedback" and body["request_id"] == rid
    assert body["answered_by"] == "smollm2" and body["latency_ms"] is not None
    again = post(replicas, mine, "/v1/feedback", {"request_id": rid, "score": 1})
    assert again.status_code == 200
    [first, last] = ratings(replicas, rid)
    assert (first["score"], first["labels"], first["comment"]) == (
        -0.5, ["too short"], "It stopped early.")
    assert first["model"] == "smollm2" and first["tenant"] != "" and first["key_id"]
    assert last["score"] == 1.0 and last["ts_ms"] >= first["ts_ms"]


def test_ratings_are_counted_latest_per_request_in_usage(replicas: Replicas) -> None:
    """The accounting app joins each rating to its model and deployment: /v1/usage
    and `conveyor usage` show each request's latest rating, once."""
    tenant = f"t{uuid.uuid4().hex[:8]}"
    _, secret = replicas.key(tenant=tenant)
    ids = []
    for _ in range(2):
        answer = post(replicas, secret, "/v1/chat/completions", {
            "model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200, answer.text
        ids.append(answer.json()["id"])
    for named, score in ((ids[0], -1), (ids[0], 1), (ids[1], 0.5)):
        assert post(replicas, secret, "/v1/feedback",
                    {"request_id": named, "score": score}).status_code == 200

    def ratings_now() -> list[dict[str, object]]:
        usage = httpx.get(f"{replicas.urls[0]}/v1/usage", timeout=10,
                          headers={"Authorization": f"Bearer {secret}"})
        assert usage.status_code == 200, usage.text
        return usage.json()["ratings"]

    # the accounting app counts what it reads; under the whole suite it has been
    # over 30 s behind (the wait ends as soon as both ratings are counted)
    deadline = time.monotonic() + 120
    while not ratings_now() or ratings_now()[-1]["count"] != 2:
        assert time.monotonic() < deadline, (ratings_now(), replicas.p.tail("accounting", 80))
        time.sleep(0.3)
    [day] = ratings_now()
    assert day["mean"] == 0.75  # the first answer's latest rating (1) and the second's
    assert day["by_model"] == {"smollm2": {"count": 2, "mean": 0.75}}
    assert day["by_deployment"] == {"smollm2": {"count": 2, "mean": 0.75}}
    shown = json.loads(replicas.p.cli("usage", "--tenant", tenant, "--json"))
    assert shown["ratings"][0]["count"] == 2 and shown["ratings"][0]["mean"] == 0.75


def test_ratings_an_earlier_conveyor_counted_in_two_tables_survive_the_upgrade(
        replicas: Replicas) -> None:
    """An accounting app of the earlier Conveyor kept ratings in two tables; the
    upgraded one, started over their changelogs, shows those ratings as its own
    (workers/usage/run.py), beside the ones it had counted already."""
    tenant = f"old{uuid.uuid4().hex[:8]}"
    now = int(time.time() * 1000)
    old = Ratings({}, lambda: now)
    for offset, (rid, score) in enumerate([("x1", 1.0), ("x2", 0.0), ("x1", -1.0)]):
        assert old.count(rating(rid, score, tenant=tenant, ts_ms=now, model="smollm2",
                                answered_by="smollm2"), 0, offset)
    app_id = replicas.p.settings.kafka.group("accounting")
    tables = {"feedback-totals": [(k, v) for k, v in old.table.items()
                                  if not k.startswith(LATEST)],
              "feedback-latest": [(k[len(LATEST):], v) for k, v in old.table.items()
                                  if k.startswith(LATEST)]}

    async def write_old_changelogs() -> None:
        names = {t: f"{app_id}-{t}-changelog" for t in tables}
        admin = AIOKafkaAdminClient(bootstrap_servers=replicas.p.settings.kafka.bootstrap)
        await admin.start()
        producer = AIOKafkaProducer(bootstrap_servers=replicas.p.settings.kafka.bootstrap)
        await producer.start()
        try:
            await admin.create_topics([NewTopic(n, 1, 1) for n in names.values()])
            for table, items in tables.items():
                for key, value in items:
                    await producer.send_and_wait(names[table], json.dumps(value).encode(),
                                                 key=json.dumps(key).encode())
        finally:
            await producer.stop()
            await admin.close()

    # a rating today's app counted before the upgrade
    live_tenant_name = f"new{uuid.uuid4().hex[:8]}"
    _, secret = replicas.key(tenant=live_tenant_name)
    answer = post(replicas, secret, "/v1/chat/completions", {
        "model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 200, answer.text
    assert post(replicas, secret, "/v1/feedback",
                {"request_id": answer.json()["id"], "score": 1}).status_code == 200

    def shown(who: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = json.loads(
            replicas.p.cli("usage", "--tenant", who, "--json"))["ratings"]
        return out

    def until_counted(who: str, count: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + 120
        while not (days := shown(who)) or days[0]["count"] != count:
            assert time.monotonic() < deadline, (days, replicas.p.tail("accounting", 80))
            time.sleep(0.5)
        return days

    until_counted(live_tenant_name, 1)
    replicas.p.kill("accounting")
    asyncio.run(write_old_changelogs())
    replicas.p.respawn("accounting")
    [day] = until_counted(tenant, 2)
    assert day["mean"] == -0.5  # x1's latest rating (-1) and x2's (0)
    assert day["by_deployment"] == {"smollm2": {"count": 2, "mean": -0.5}}
    [day] = shown(live_tenant_name)  # what the app had counted is still there
    assert (day["count"], day["mean"]) == (1, 1.0)
