"""Resumable SSE streams on the real pipeline: a stream dropped after three
events and resumed (Last-Event-ID, ``?starting_after``, from the start) gives
the same answer as an uninterrupted one, on the same gateway and on another
replica after the first was SIGKILLed."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.pipeline import ROOT, Pipeline

CHAT: dict[str, Any] = {
    "model": "smollm2", "temperature": 0, "seed": 4242, "max_tokens": 40, "stream": True,
    "messages": [{"role": "user", "content": "Name the planets of the solar system."}]}
# a completion that runs on to max_tokens (it counts), long enough to outlive a lease
COUNTING: dict[str, Any] = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5,", "temperature": 0,
                            "seed": 4242, "stream": True}


@dataclass
class Event:
    id: str | None
    data: str

    @property
    def seq(self) -> int:
        assert self.id is not None
        return int(self.id.rpartition(":")[2])


def events(r: httpx.Response, limit: int | None = None) -> list[Event]:
    """The stream's data events, [DONE] included (its id is None)."""
    out: list[Event] = []
    event_id: str | None = None
    for line in r.iter_lines():
        if line.startswith("id: "):
            event_id = line[len("id: "):]
        elif line.startswith("data: "):
            out.append(Event(event_id, line[len("data: "):]))
            event_id = None
            if limit is not None and len(out) >= limit:
                break
    return out


def text(evs: list[Event]) -> str:
    parts: list[str] = []
    for e in evs:
        if e.data == "[DONE]":
            continue
        choice = (json.loads(e.data).get("choices") or [{}])[0]
        parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(parts)


def stream_id(evs: list[Event]) -> str:
    return str(json.loads(evs[0].data)["id"])


def whole(url: str, route: str, body: dict[str, Any]) -> list[Event]:
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=120) as r:
        assert r.status_code == 200
        return events(r)


def dropped_after_three(url: str, route: str, body: dict[str, Any],
                        then: Callable[[], None] = lambda: None) -> list[Event]:
    """The first three events of a stream whose connection is then closed
    (``then`` runs before it closes: to kill its gateway, say)."""
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=120) as r:
        assert r.status_code == 200
        got = events(r, limit=3)
        then()
    return got


def resumed(url: str, route: str, sid: str, *, last: str | None = None,
            query: str = "") -> list[Event]:
    headers = {"Last-Event-ID": last} if last else {}
    with httpx.stream("GET", f"{url}{route}/{sid}/stream{query}", headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return events(r)


def assert_joined(first: list[Event], rest: list[Event], reference: list[Event]) -> None:
    """No gap, no repeat: the ids run on from the last one the client had."""
    numbered = [e for e in first + rest if e.id is not None]
    assert [e.seq for e in numbered] == list(range(len(numbered)))
    assert rest[-1].data == "[DONE]"
    assert text(first + rest) == text(reference)


def test_a_dropped_stream_resumes_where_it_broke_off(pipeline: Pipeline) -> None:
    url, route = pipeline.base_url, "/v1/chat/completions"
    reference = whole(url, route, CHAT)
    first = dropped_after_three(url, route, CHAT)
    sid = stream_id(first)
    assert sid.startswith("chatcmpl-") and first[-1].id == f"{sid.removeprefix('chatcmpl-')}:2"
    rest = resumed(url, route, sid, last=first[-1].id)
    assert_joined(first, rest, reference)
    assert json.loads(rest[-2].data)["choices"][0]["finish_reason"] in ("stop", "length")


def test_starting_after_and_from_the_start_read_the_recorded_stream(pipeline: Pipeline
                                                                    ) -> None:
    url, route = pipeline.base_url, "/v1/chat/completions"
    original = whole(url, route, {**CHAT, "seed": 7})
    sid = stream_id(original)
    assert resumed(url, route, sid, query="?starting_after=1") == original[2:]
    assert resumed(url, route, sid) == original


def test_unknown_or_mismatched_streams_are_404(pipeline: Pipeline) -> None:
    url = pipeline.base_url
    r = httpx.get(f"{url}/v1/chat/completions/chatcmpl-{'0' * 32}/stream", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    original = whole(url, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    r = httpx.get(f"{url}/v1/completions/{stream_id(original)}/stream", timeout=30)
    assert r.status_code == 404


def test_only_the_requests_tenant_may_resume_it(pipeline: Pipeline) -> None:
    secret = f"conveyor-test-resume-{uuid.uuid4().hex}"
    env = {"CONVEYOR_AUTH": "keys", "CONVEYOR_AUTH_SECRET": secret}

    def key(tenant: str) -> dict[str, str]:
        out = subprocess.run([sys.executable, "-m", "cli", "keys", "create", "--tenant",
                              tenant, "--name", "resume"], env={**pipeline.env, **env}, cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        found = re.search(r"cvy-\S+", out.strip().splitlines()[-1])
        assert found is not None, out
        return {"Authorization": f"Bearer {found.group(0)}"}

    url = pipeline.start_gateway("gateway-keys", **env)
    try:
        owner, stranger = key(f"t{uuid.uuid4().hex[:8]}"), key(f"t{uuid.uuid4().hex[:8]}")
        with httpx.stream("POST", f"{url}/v1/chat/completions", headers=owner, timeout=120,
                          json={**CHAT, "max_tokens": 4}) as r:
            assert r.status_code == 200
            original = events(r)
        route = f"{url}/v1/chat/completions/{stream_id(original)}/stream"
        assert httpx.get(route, headers=stranger, timeout=30).status_code == 404
        with httpx.stream("GET", route, headers=owner, timeout=60) as r:
            assert r.status_code == 200 and events(r) == original
    finally:
        pipeline.kill("gateway-keys", signal.SIGTERM)


def test_the_rest_comes_from_another_replica_after_a_sigkill(
        pipeline_factory: Callable[..., Pipeline]) -> None:
    # a short lease: without the resumed stream's watch, the worker would cancel
    # the generation 2 lease periods (4 s) after its gateway died
    p = pipeline_factory(workers=1, contexts=1, CONVEYOR_REPLY_LEASE_TTL_S="2")
    other = p.start_gateway("gateway-b")
    route = "/v1/completions"
    body = {**COUNTING, "max_tokens": 400}
    started = time.monotonic()
    reference = whole(other, route, body)
    took = time.monotonic() - started
    first = dropped_after_three(p.base_url, route, body, then=lambda: p.kill("gateway"))
    rest = resumed(other, route, stream_id(first), last=first[-1].id)
    assert_joined(first, rest, reference)
    assert json.loads(rest[-2].data)["choices"][0]["finish_reason"] == "length"
    assert took > 5, f"the answer took {took:.1f} s: too short to show it outlives the lease"
