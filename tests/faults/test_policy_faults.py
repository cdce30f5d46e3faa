"""Personal data under faults (real processes, a Redis of the test's own):
streams holding personal data while the layers process is SIGKILLed and
Redis's data is flushed, then the gateway SIGKILLed and started again. Every
answer is whole and restored, and no topic, Redis value or process log ever
holds the originals: the policy lives on conveyor.policies, not in Redis, and
a restarted gateway reads it before it serves."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.pipeline import Pipeline
from tests.support.services import OwnRedis
from tests.support.topics import traces_of

ECHO = ("--engine", "scripted", "--script", "echo", "--token-delay-ms", "40")
POLICY = '[pii]\nredact = ["email", "phone", "card", "iban", "ip"]\nrestore = true\n'


@pytest.fixture
def p(services: None, own_redis: OwnRedis, tmp_path: Path) -> Iterator[Pipeline]:
    logs = tmp_path / "logs"
    logs.mkdir()
    made = Pipeline(logs, engine=ECHO, CONVEYOR_REDIS_URL=own_redis.url)
    try:
        made.start(workers=1, contexts=4)
        yield made
    finally:
        made.close()


def said(i: int) -> str:
    """A long message (the echo engine streams it back a word at a time) with
    personal data of its own."""
    words = " ".join(f"word{j}" for j in range(30))
    return (f"{words} write to person{i}.x9@example.org, call +44 20 7946 09{i:02d}, "
            f"pay into GB82 WEST 1234 5698 7654 32 from 10.9.{i}.7 {words}")


def streamed(p: Pipeline, content: str) -> str:
    text = []
    with httpx.stream("POST", f"{p.base_url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "max_tokens": 200, "stream": True,
            "messages": [{"role": "user", "content": content}]}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def test_no_personal_data_reaches_the_log_through_kills_and_a_flush(
        p: Pipeline, own_redis: OwnRedis, tmp_path: Path) -> None:
    policy = tmp_path / "pii.toml"
    policy.write_text(POLICY)
    p.cli("policies", "set", "--default", str(policy))
    needles: list[str] = []

    def redacted_now() -> bool:
        probe = f"probe-{uuid.uuid4().hex[:6]}@example.net"
        out = streamed(p, f"hello {probe}")
        return probe in out and not traces_of(p, [probe.encode()], logs=False)

    deadline = time.monotonic() + 15
    while not redacted_now():
        assert time.monotonic() < deadline, "the gateway never applied the policy"

    answers: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, streamed(p, said(i))))
               for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the answers are streaming
    p.kill("layers")
    own_redis.flush()
    p.heal(own_redis)
    for t in threads:
        t.join(timeout=120)
    assert sorted(answers) == [0, 1, 2, 3]
    for i, text in answers.items():
        assert text == said(i), (i, text)
        needles += [f"person{i}.x9@example.org", f"+44 20 7946 09{i:02d}", f"10.9.{i}.7"]

    p.kill("gateway")
    p.heal(own_redis)  # the new gateway reads the policy from the log, not from Redis
    assert streamed(p, said(7)) == said(7)
    needles += ["person7.x9@example.org", "GB82 WEST 1234 5698 7654 32"]
    assert traces_of(p, [n.encode() for n in needles]) == []
