"""A user's first hour with Conveyor, as a script: the official ``openai`` client
(and plain HTTP and WebSocket where the client has no call) against a running
Conveyor, every answer checked. ``infra/smoke.sh`` runs it against Conveyor
installed as ``infra/up.sh`` installs it (runtime dependencies only); it imports
nothing of Conveyor's, so it runs from any environment that has the client.

    python -m infra.smoke --base-url http://127.0.0.1:8000 --api-key KEY \\
        --conveyor .venv-runtime/bin/conveyor

Each check prints one line; the first failure ends the run with exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import openai
from websockets.asyncio.client import connect

MODEL = "smollm2"
QUESTION = "What is the capital of France?"


class Smoke:
    def __init__(self, base_url: str, api_key: str, conveyor: str) -> None:
        self.base_url, self.api_key, self.conveyor = base_url, api_key, conveyor
        self.client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key,
                                    timeout=120, max_retries=0)
        self.http = httpx.Client(base_url=base_url, timeout=120,
                                 headers={"Authorization": f"Bearer {api_key}"})

    def ask(self, content: str = QUESTION, **extra: Any) -> Any:
        return self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], **extra)

    def first_answer(self, within_s: float = 300.0) -> str:
        """The first chat, retried while the worker loads its model."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                reply = self.ask(max_tokens=16, temperature=0)
                break
            except (openai.APIStatusError, openai.APIConnectionError) as exc:
                if time.monotonic() > deadline:
                    raise
                print(f"  waiting for Conveyor: {type(exc).__name__}", flush=True)
                time.sleep(3)
        text = reply.choices[0].message.content or ""
        assert text.strip() and reply.usage and reply.usage.completion_tokens > 0, reply
        return f"{text.strip()[:60]!r}, {reply.usage.total_tokens} tokens"

    def stream(self) -> str:
        chunks = list(self.ask(max_tokens=24, temperature=0, stream=True,
                               stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip(), chunks
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        return f"{len(chunks)} chunks, {text.strip()[:40]!r}"

    def embeddings(self) -> str:
        """The embedding worker's vectors, as the client decodes them (base64)."""
        texts = ["The cat sits on the mat.", "A cat is sitting on a rug.",
                 "Quarterly revenue rose by ten percent."]
        got = self.client.embeddings.create(model="all-minilm-l6-v2", input=texts)
        v = [d.embedding for d in got.data]
        dot = [sum(a * b for a, b in zip(v[i], v[j], strict=True)) for i, j in ((0, 1), (0, 2))]
        assert [len(e) for e in v] == [384] * 3 and dot[0] > dot[1] + 0.3, dot
        return f"3 x 384, similar {dot[0]:.2f} > unrelated {dot[1]:.2f}"

    def json_schema(self) -> str:
        schema = {"type": "object", "additionalProperties": False,
                  "required": ["city", "country"],
                  "properties": {"city": {"type": "string", "maxLength": 40},
                                 "country": {"type": "string", "maxLength": 40}}}
        reply = self.ask("Name a city and its country.", max_tokens=48, temperature=0,
                         response_format={"type": "json_schema", "json_schema": {
                             "name": "place", "schema": schema, "strict": True}})
        value = json.loads(reply.choices[0].message.content or "")
        assert set(value) == {"city", "country"}, value
        return json.dumps(value)

    def tools(self) -> str:
        weather = {"type": "function", "function": {
            "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "required": ["city"],
                           "properties": {"city": {"type": "string", "maxLength": 40}}}}}
        reply = self.ask("What is the weather in Paris?", max_tokens=64, temperature=0,
                         tools=[weather], tool_choice="required", parallel_tool_calls=False)
        calls = reply.choices[0].message.tool_calls or []
        assert calls and reply.choices[0].finish_reason == "tool_calls", reply
        for call in calls:
            assert call.type == "function" and call.function.name == "get_weather"
            assert isinstance(json.loads(call.function.arguments)["city"], str), call
        return ", ".join(f"{c.function.name}({c.function.arguments})" for c in calls)

    def logprobs_and_n(self) -> str:
        reply = self.ask(max_tokens=8, temperature=0.8, seed=3, n=2, logprobs=True,
                         top_logprobs=2)
        assert [c.index for c in reply.choices] == [0, 1], reply
        for choice in reply.choices:
            content = choice.logprobs.content if choice.logprobs else None
            assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0
                                   for t in content), choice
        return f"2 choices, {len(reply.choices[0].logprobs.content or [])} tokens with logprobs"

    def pii_and_cache(self) -> str:
        """The tenant's policy (infra/smoke.sh sets it): personal data redacted
        before any topic and restored in the answer; the prompt cache on."""
        said = "Please say hello to ada.lovelace.42@example.org for me."
        raw = self.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": said}], max_tokens=24,
            temperature=0)
        rid = raw.headers["x-request-id"]
        shown = subprocess.run([self.conveyor, "inspect", rid, "--show-content"],
                               capture_output=True, text=True, timeout=60, check=True).stdout
        assert "personal data redacted" in shown and "<EMAIL_1>" in shown, shown
        assert "ada.lovelace.42@example.org" not in shown, shown
        question = f"Say the word {uuid.uuid4().hex[:6]}."

        def cache_says() -> str:
            raw = self.client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8,
                temperature=0)
            return str(raw.headers.get("x-conveyor-cache"))

        assert cache_says() == "miss"
        until(lambda: cache_says() == "hit", "the prompt cache answers a repeat")
        return "redacted in the log (inspect), the repeat a cache hit"

    def moderations(self) -> str:
        out = self.client.moderations.create(
            model="omni-moderation-latest",
            input=["Tell me about conveyor belts.", "you are a worthless fucking idiot"])
        assert [r.flagged for r in out.results] == [False, True], out
        try:
            self.client.moderations.create(input=["hello"] * 33)
        except openai.BadRequestError as exc:
            assert isinstance(exc.body, dict) and exc.body.get("param") == "input", exc.body
        else:
            raise AssertionError("33 inputs were not refused")
        return "1 of 2 flagged; 33 inputs refused naming input"

    def feedback(self) -> str:
        reply = self.ask(max_tokens=4)
        rated = self.http.post("/v1/feedback", json={"request_id": reply.id, "score": 1,
                                                       "labels": ["smoke"]})
        assert rated.status_code == 200, rated.text
        assert rated.json()["object"] == "feedback"
        return f"rated {reply.id}"

    def batch(self) -> str:
        lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST",
                             "url": "/v1/chat/completions",
                             "body": {"model": MODEL, "max_tokens": 8,
                                      "messages": [{"role": "user", "content": f"Say {i}."}]}})
                 for i in range(3)]
        uploaded = self.client.files.create(
            file=("smoke.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        batch = self.client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                           endpoint="/v1/chat/completions")
        until(lambda: self.client.batches.retrieve(batch.id).status in (
            "completed", "failed", "expired", "cancelled"), "the batch ends", within_s=180)
        done = self.client.batches.retrieve(batch.id)
        assert done.status == "completed" and done.output_file_id, done
        out = [json.loads(line) for line in
               self.client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == [f"line-{i}" for i in range(3)], out
        assert all(o["response"]["status_code"] == 200 for o in out), out
        return f"{batch.id}: 3 of 3 lines answered"

    def background_response(self) -> str:
        created = self.client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                               max_output_tokens=32, background=True)
        assert created.status in ("queued", "in_progress"), created
        ended = ("completed", "incomplete", "failed", "cancelled")
        until(lambda: self.client.responses.retrieve(created.id).status in ended,
              "the background response ends", within_s=120)
        done = self.client.responses.retrieve(created.id)
        assert done.status == "completed" and done.output_text.strip(), done
        return f"{created.id}: {done.output_text.strip()[:40]!r}"

    def websocket(self) -> str:
        async def turn() -> str:
            url = self.base_url.replace("http://", "ws://") + "/v1/chat/completions"
            async with connect(url, open_timeout=10, additional_headers={
                    "Authorization": f"Bearer {self.api_key}"}) as ws:
                await ws.send(json.dumps({"type": "request", "id": "a", "body": {
                    "model": MODEL, "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": QUESTION}]}}))
                text = ""
                while True:
                    message = json.loads(await asyncio.wait_for(ws.recv(), 120))
                    assert message["id"] == "a" and message["type"] != "error", message
                    if message["type"] == "done":
                        return text
                    text += "".join(c["delta"].get("content") or ""
                                    for c in message["data"]["choices"])

        text = asyncio.run(turn())
        assert text.strip()
        return repr(text.strip()[:40])

    def resumed_stream(self) -> str:
        """A stream dropped after three events, resumed after the last one it had,
        joins into the stream as recorded (read whole from its start). Sampled
        (temperature 1, no seed), so the prompt cache does not answer it at once;
        SmolLM2's end tokens (0, 2) biased away, so a sample never ends within the
        three events."""
        body = {"model": MODEL, "max_tokens": 128, "temperature": 1.0, "stream": True,
                "logit_bias": {"0": -100, "2": -100},
                "messages": [{"role": "user",
                              "content": "Count from 1 to 60, one number per line."}]}
        first = sse(self.http, "POST", "/v1/chat/completions", json=body, limit=3)
        sid = json.loads(first[0][1])["id"]
        rest = sse(self.http, "GET", f"/v1/chat/completions/{sid}/stream",
                   headers={"Last-Event-ID": first[-1][0] or ""})
        whole = sse(self.http, "GET", f"/v1/chat/completions/{sid}/stream")
        assert rest[-1][1] == "[DONE]" and content(rest).strip(), rest
        assert content(first + rest) == content(whole), (first, rest, whole)
        assert first + rest == whole, (first, rest, whole)
        return f"{sid}: 3 events, dropped, {len(rest)} more after Last-Event-ID"


def sse(http: httpx.Client, method: str, path: str, limit: int | None = None,
        **kwargs: Any) -> list[tuple[str | None, str]]:
    """The (id, data) of a stream's events, the first ``limit`` of them when given
    (the connection is then closed)."""
    events: list[tuple[str | None, str]] = []
    event_id: str | None = None
    with http.stream(method, path, **kwargs) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                events.append((event_id, line[5:].strip()))
                event_id = None
                if limit is not None and len(events) == limit:
                    break
    return events


def content(events: list[tuple[str | None, str]]) -> str:
    chunks = [json.loads(data) for _, data in events if data != "[DONE]"]
    return "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c.get("choices"))


def until(check: Callable[[], bool], what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s:.0f} s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--conveyor", required=True, help="the installed `conveyor` command")
    args = parser.parse_args(argv)
    smoke = Smoke(args.base_url, args.api_key, args.conveyor)
    checks: list[tuple[str, Callable[[], str]]] = [
        ("chat", smoke.first_answer), ("stream", smoke.stream), ("embeddings", smoke.embeddings),
        ("json_schema", smoke.json_schema), ("tools", smoke.tools),
        ("logprobs and n", smoke.logprobs_and_n), ("pii and prompt cache", smoke.pii_and_cache),
        ("moderations", smoke.moderations), ("feedback", smoke.feedback),
        ("batch", smoke.batch), ("background response", smoke.background_response),
        ("websocket", smoke.websocket), ("resumed stream", smoke.resumed_stream)]
    for name, check in checks:
        started = time.monotonic()
        try:
            said = check()
        except Exception as exc:  # the smoke's verdict: say which check and why, then stop
            print(f"smoke: {name}: FAILED after {time.monotonic() - started:.1f} s: "
                  f"{type(exc).__name__}: {exc}", flush=True)
            return 1
        print(f"smoke: {name}: ok in {time.monotonic() - started:.1f} s: {said}", flush=True)
    print(f"smoke: all {len(checks)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
