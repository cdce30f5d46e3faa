"""The console against a running Conveyor: the fleet as the heartbeats tell,
and a request's journey through every layer, its content only when asked."""

from __future__ import annotations

import time
import uuid

import httpx

from tests.support.pipeline import Pipeline, client
from workers.journey import LAYERS


def test_the_fleet_and_a_request_s_journey_are_shown(pipeline: Pipeline) -> None:
    word = f"pumpkin{uuid.uuid4().hex[:6]}"
    answer = client(pipeline).chat.completions.create(
        model="smollm2", max_tokens=4,
        messages=[{"role": "user", "content": f"Say a secret word: {word}"}])
    rid = answer.id.removeprefix("chatcmpl-")
    base = f"{pipeline.base_url}/console"

    deadline = time.monotonic() + 30
    while 'data-worker="w0"' not in (rows := httpx.get(f"{base}/fleet/rows", timeout=10)).text:
        assert time.monotonic() < deadline, rows.text
        time.sleep(0.5)
    assert rows.status_code == 200 and "ready" in rows.text

    page = httpx.get(f"{base}/requests/{rid}", timeout=30)
    assert page.status_code == 200, page.text
    for step in (*LAYERS, "reply"):
        assert f'data-step="{step}"' in page.text, step
    assert word not in page.text  # content only when asked
    shown = httpx.get(f"{base}/requests/{rid}", params={"content": "1"}, timeout=30)
    assert word in shown.text

    found = httpx.get(f"{base}/requests", params={"id": rid}, follow_redirects=False)
    assert found.status_code == 303 and found.headers["location"].endswith(rid)
    missing = httpx.get(f"{base}/requests/{uuid.uuid4().hex}", timeout=30)
    assert missing.status_code == 404 and "No request" in missing.text
