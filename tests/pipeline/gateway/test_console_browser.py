"""The console in a real browser (Debian's chromium, driven by Playwright)
against a running Conveyor: each page loads with no console error; the
overview draws the pipeline's groups and each model's last hour; the fleet
shows the workers; a request sent through the API appears in the live tail
and opens, from the keyboard, as its journey through every layer, which a
replay compares layer by layer; an API key made in the page
works on the API and, revoked in the page, stops working; a dead letter is
listed, opened and its redrive answered. With CONVEYOR_CONSOLE_SHOTS set
to a folder, each page's screenshot is written there (the docs' pictures)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form
from playwright.sync_api import Browser, Page, sync_playwright

from schemas.codec import default_codec
from tests.support.auth import Replicas
from tests.support.factories import encoded_with
from tests.support.factories import request as make_request
from tests.support.pipeline import Pipeline, client
from topics.clients import make_producer
from topics.envelope import new_request_id, now_ms
from workers.journey import LAYERS

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = os.environ.get("CONVEYOR_CONSOLE_SHOTS")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        # --no-sandbox: the tests may run as root, where chromium's sandbox will not start
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    opened = browser.new_page(viewport={"width": 1280, "height": 800})
    errors: list[str] = []
    opened.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield opened
    finally:
        opened.close()
    assert errors == [], errors


def shot(page: Page, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=True)


def test_the_fleet_shows_the_workers_and_stays_live(pipeline: Pipeline, page: Page) -> None:
    page.goto(f"{pipeline.base_url}/console")
    assert page.url.endswith("/console/overview")
    page.get_by_role("link", name="Fleet").click()
    row = page.locator('tr[data-worker="w0"]')
    row.wait_for(timeout=30_000)
    assert "ready" in row.inner_text()
    # the rows are fetched again, every two seconds
    with page.expect_response(lambda r: r.url.endswith("/console/fleet/rows"), timeout=10_000):
        pass
    shot(page, "fleet")


def test_a_request_s_journey_opens_from_the_keyboard(pipeline: Pipeline, page: Page) -> None:
    word = f"pumpkin{uuid.uuid4().hex[:6]}"
    answer = client(pipeline).chat.completions.create(
        model="smollm2", max_tokens=4,
        messages=[{"role": "user", "content": f"Say a secret word: {word}"}])
    rid = answer.id.removeprefix("chatcmpl-")
    page.goto(f"{pipeline.base_url}/console/requests")
    field = page.locator("#id")
    assert field.evaluate("field => field === document.activeElement")  # focused at once
    field.fill(rid)
    field.press("Enter")
    page.wait_for_url(f"**/console/requests/{rid}", timeout=30_000)
    for step in (*LAYERS, "reply"):
        assert page.locator(f'tr[data-step="{step}"]').count() == 1, step
    assert word not in page.content()
    shot(page, "request")
    page.get_by_role("link", name="Show the prompt and the answer").click()
    page.wait_for_url("**content=1")
    assert word in page.locator("pre.prompt").inner_text()


ADMIN = "admin-token-of-the-console-browser-test"


@pytest.fixture(scope="module")
def keyed(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """A Conveyor with API keys on and an admin token: the console signs in."""
    p = Pipeline(tmp_path_factory.mktemp("console-keys"), CONVEYOR_AUTH="keys",
                 CONVEYOR_AUTH_SECRET="console-test-secret-" + uuid.uuid4().hex,
                 CONVEYOR_ADMIN_TOKEN=ADMIN)

    def start() -> None:
        p.cli("topics")
        _, p.api_key = Replicas(p, "", "").key(tenant="ops")  # its own, to see it ready
        p.start(workers=1)
        p.spawn("accounting", "accounting")  # the usage page reads what it counts

    # started and closed in a thread of their own: the browser's event loop may be
    # running in this one, and both make and drop topics with asyncio.run
    with ThreadPoolExecutor(1) as aside:
        try:
            aside.submit(start).result()
            yield p
        finally:
            aside.submit(p.close).result()


def sign_in(page: Page, p: Pipeline) -> None:
    page.goto(f"{p.base_url}/console/keys")
    page.wait_for_url("**/console/signin")
    token = page.locator("#token")
    assert token.evaluate("field => field === document.activeElement")  # focused at once
    token.fill(ADMIN)
    token.press("Enter")
    page.wait_for_url("**/console/overview")


def test_a_key_made_in_the_page_works_until_it_is_revoked_there(
        keyed: Pipeline, page: Page) -> None:
    sign_in(page, keyed)
    page.goto(f"{keyed.base_url}/console/keys")
    tenant = f"console-{uuid.uuid4().hex[:6]}"
    page.locator("#new-tenant").fill(tenant)
    page.locator("#new-name").fill("made in the console")
    page.get_by_role("button", name="Create the key").click()
    secret = page.locator("#secret").inner_text().strip()
    assert secret.startswith("cvy-")

    def ask() -> int:
        answer = httpx.post(f"{keyed.base_url}/v1/chat/completions", timeout=60,
                            headers={"authorization": f"Bearer {secret}"},
                            json={"model": "smollm2", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "Hi"}]})
        return answer.status_code

    assert ask() == 200
    page.goto(f"{keyed.base_url}/console/keys?tenant={tenant}")
    shot(page, "keys")
    page.get_by_role("link", name="Revoke…").click()
    page.get_by_role("button", name="Revoke it").click()
    page.wait_for_url("**/console/keys")
    deadline = time.monotonic() + 10
    while (status := ask()) != 401:
        assert time.monotonic() < deadline, status
        time.sleep(0.2)


def test_a_dead_letter_is_listed_opened_and_its_redrive_answered(
        pipeline: Pipeline, page: Page) -> None:
    """A record the pipeline cannot read is dead-lettered by preprocess; the page
    lists it, opens it with its error, and a redrive from the page is refused
    with the reason (it still does not decode), as ``conveyor dlq`` refuses it."""
    key = f"poison-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(1) as aside:  # the browser's event loop runs in this thread
        aside.submit(asyncio.run, _produce(pipeline, key, b"\x00not an event")).result()
    page.goto(f"{pipeline.base_url}/console/dead-letters")
    deadline = time.monotonic() + 30
    while page.locator(f'tr:has-text("{key}")').count() == 0:
        assert time.monotonic() < deadline, page.content()
        page.wait_for_timeout(500)
        page.reload()
    shot(page, "dead-letters")
    page.locator(f'tr:has-text("{key}") a').first.click()
    assert "no:" in page.locator("dl.facts").inner_text()  # it does not decode
    page.get_by_role("button", name="Redrive it").click()
    assert "Not redriven: its value still does not decode" in page.locator(
        "p.refused").inner_text()


def test_a_dead_letter_redriven_after_an_upgrade_is_answered(
        keyed: Pipeline, page: Page, tmp_path: Path) -> None:
    """A request written with a schema version the layers do not know yet (a
    gateway upgraded before them) is dead-lettered; once the layers and the
    gateway know that version (CONVEYOR_SCHEMA_HISTORY, the upgrade), the
    page redrives it and the pipeline answers it."""
    history = tmp_path / "history"
    history.mkdir()
    schema = json.loads(to_parsing_canonical_form(default_codec().schema("Request")))
    schema["fields"].append({"name": "hint", "type": "string"})
    (history / "conveyor.Request.v99.avsc").write_text(json.dumps(schema))
    rid = new_request_id()
    hi: Any = {"role": "user", "content": "Hi", "name": None, "tool_calls": None,
               "tool_call_id": None}
    record: dict[str, Any] = dict(make_request([hi], request_id=rid, max_tokens=3))
    record["envelope"]["tenant"] = "ops"
    record["envelope"]["deadline_ms"] = now_ms() + 300_000
    poison = encoded_with(parse_schema(schema, _write_hint=False), record | {"hint": "newer"})
    with ThreadPoolExecutor(1) as aside:
        aside.submit(asyncio.run, _produce(keyed, rid, poison)).result()
    sign_in(page, keyed)
    page.goto(f"{keyed.base_url}/console/dead-letters")
    deadline = time.monotonic() + 30
    while page.locator(f'tr:has-text("{rid}")').count() == 0:
        assert time.monotonic() < deadline, page.content()
        page.wait_for_timeout(500)
        page.reload()
    page.locator(f'tr:has-text("{rid}") a').first.click()
    letter_url = page.url
    assert "unknown schema fingerprint" in page.locator("dl.facts").inner_text()

    # the upgrade: the layers and the gateway read the newer version
    upgraded = {"CONVEYOR_SCHEMA_HISTORY": str(history)}
    for name, args in (("layers", ("layer",)), ("gateway", ("gateway",))):
        keyed.kill(name, signal.SIGTERM)
        keyed.spawn(name, *args, env=upgraded)
    keyed.wait_ready()
    page.goto(letter_url)
    assert "yes, it can be redriven" in page.locator("dl.facts").inner_text()
    page.get_by_role("button", name="Redrive it").click()
    assert "Redriven to" in page.locator("p.done").inner_text()
    page.get_by_role("link", name="Follow its request").click()
    deadline = time.monotonic() + 60
    while page.locator('tr[data-step="reply"]').count() == 0:  # answered
        assert time.monotonic() < deadline, page.content()
        page.wait_for_timeout(1000)
        page.reload()
    assert page.locator('tr[data-step="postprocess"]').count() == 1
    assert "Finish</dt><dd>length" in page.content()  # its answer, not an error


async def _produce(p: Pipeline, key: str, value: bytes) -> None:
    producer = make_producer(p.settings.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(p.settings.kafka.topic("requests"), value, key=key.encode())
    finally:
        await producer.stop()




def test_a_tenant_s_usage_shows_its_requests(keyed: Pipeline, page: Page) -> None:
    answer = httpx.post(f"{keyed.base_url}/v1/chat/completions", timeout=60,
                        headers={"authorization": f"Bearer {keyed.api_key}"},
                        json={"model": "smollm2", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 200
    sign_in(page, keyed)
    deadline = time.monotonic() + 30
    while True:  # counted by the accounting app, then mirrored into Redis
        page.goto(f"{keyed.base_url}/console/usage?tenant=ops&span=hour")
        if page.locator("tr[data-bucket]").count():
            break
        assert time.monotonic() < deadline, page.content()
        page.wait_for_timeout(1000)
    assert int(page.locator("tr[data-bucket] td").nth(1).inner_text()) >= 1
    shot(page, "usage")


def _ask(p: Pipeline, content: str = "Hi") -> str:
    """A chat request with the keyed Conveyor's own key; its request id."""
    answer = httpx.post(f"{p.base_url}/v1/chat/completions", timeout=60,
                        headers={"authorization": f"Bearer {p.api_key}"},
                        json={"model": "smollm2", "max_tokens": 2,
                              "messages": [{"role": "user", "content": content}]})
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"]).removeprefix("chatcmpl-")


def test_the_overview_draws_the_pipeline_and_each_model_s_last_hour(
        keyed: Pipeline, page: Page) -> None:
    _ask(keyed)
    sign_in(page, keyed)
    page.goto(f"{keyed.base_url}/console/overview")
    for layer in ("preprocess", "route", "schedule", "infer:cpu", "postprocess", "accounting"):
        group = page.locator(f'li[data-group="{layer}"]')
        assert group.count() == 1, (layer, page.locator("#pipeline").inner_text())
    assert "member" in page.locator('li[data-group="route"]').inner_text()
    # the pipeline is fetched again every two seconds, the charts every ten
    with page.expect_response(lambda r: r.url.endswith("/console/overview/pipeline"),
                              timeout=10_000):
        pass
    page.locator('section[data-model="smollm2"] svg rect').first.wait_for(timeout=30_000)
    chart = page.locator('section[data-model="smollm2"] svg').first
    assert "Requests/s: last minute" in (chart.get_attribute("aria-label") or "")
    shot(page, "overview")


def test_a_request_appears_in_the_live_tail_and_opens_as_its_journey(
        keyed: Pipeline, page: Page) -> None:
    sign_in(page, keyed)
    page.goto(f"{keyed.base_url}/console/requests")
    rid = _ask(keyed, "Tell me about the tail")
    arrived = page.locator(f'#arriving tr[data-arrived="{rid}"]')
    arrived.wait_for(timeout=30_000)  # as it came, then what became of it
    assert "ops" in arrived.inner_text()
    row = page.locator(f'tr[data-request="{rid}"]')
    row.wait_for(timeout=30_000)  # no reload: the table is fetched again by itself
    assert "ops" in row.inner_text() and "smollm2" in row.inner_text()
    shot(page, "requests")
    link = row.get_by_role("link")
    link.focus()
    link.press("Enter")
    page.wait_for_url(f"**/console/requests/{rid}")
    for step in (*LAYERS, "reply"):
        assert page.locator(f'tr[data-step="{step}"]').count() == 1, step
    assert page.locator("#resume").inner_text() == f"/v1/chat/completions/{rid}/stream"

    # a search by tenant and model finds it; one by another model does not
    page.goto(f"{keyed.base_url}/console/requests?tenant=ops&model=smollm2&since=1h")
    assert page.locator(f'tr[data-request="{rid}"]').count() == 1
    page.goto(f"{keyed.base_url}/console/requests?model=another-model")
    assert page.locator(f'tr[data-request="{rid}"]').count() == 0
    assert "No request matches" in page.locator("table.found").inner_text()


def test_routing_lately_counts_a_refusal_and_a_fallback(
        keyed: Pipeline, page: Page) -> None:
    """A request no worker can take (its pool has none) is refused by schedule;
    the layer that refuses it writes its usage record, so the fleet's routing
    lately counts it under its code and the search finds it as an error. One
    for a model whose pool has no worker but a fallback is counted under the
    model that answered, for the one asked."""
    refused = httpx.post(f"{keyed.base_url}/v1/chat/completions", timeout=60,
                         headers={"authorization": f"Bearer {keyed.api_key}"},
                         json={"model": "ghost", "messages": [{"role": "user", "content": "Hi"}]})
    assert refused.status_code == 503, refused.text
    rid = refused.headers["x-request-id"]
    fallen = httpx.post(f"{keyed.base_url}/v1/chat/completions", timeout=60,
                        headers={"authorization": f"Bearer {keyed.api_key}"},
                        json={"model": "phantom", "max_tokens": 2,
                              "messages": [{"role": "user", "content": "Hi"}]})
    assert fallen.headers["x-conveyor-fallback"] == "smollm2-135m-instruct"
    sign_in(page, keyed)
    page.goto(f"{keyed.base_url}/console/fleet")
    ghost = page.locator('#routing tr[data-model="ghost"]')
    ghost.wait_for(timeout=30_000)  # filled as the page opens, then every ten seconds
    assert "no_worker_available 1" in ghost.inner_text()
    answered = page.locator('#routing tr[data-model="smollm2-135m-instruct"]')
    answered.wait_for(timeout=30_000)
    assert "phantom 1" in answered.inner_text()  # the fallback, told apart
    page.goto(f"{keyed.base_url}/console/requests?status=error&model=ghost")
    row = page.locator(f'tr[data-request="{rid}"]')
    assert row.count() == 1 and "no_worker_available" in row.inner_text()


def test_a_replay_from_the_journey_page_compares_layer_by_layer(
        keyed: Pipeline, page: Page) -> None:
    rid = _ask(keyed, "Replay me")
    sign_in(page, keyed)
    page.goto(f"{keyed.base_url}/console/requests/{rid}")
    page.locator("#through").select_option("preprocess,route")
    page.get_by_role("button", name="Replay and compare").click()
    page.wait_for_url(f"**/console/requests/{rid}/replay", timeout=60_000)
    assert "wrote what the log holds" in page.locator("#verdict").inner_text()
    for layer in ("preprocess", "route"):
        assert "same" in page.locator(f'section[data-layer="{layer}"] h2').inner_text()
    shot(page, "replay")


def test_the_policy_that_applies_to_a_tenant_is_shown(
        keyed: Pipeline, page: Page, tmp_path: Path) -> None:
    tenant = f"policy-{uuid.uuid4().hex[:6]}"
    policy = tmp_path / "policy.toml"
    policy.write_text('[pii]\nredact = ["email"]\n\n[cache]\nenabled = true\nttl_s = 120\n')
    with ThreadPoolExecutor(1) as aside:  # the CLI runs its own event loop
        aside.submit(keyed.cli, "policies", "set", "--tenant", tenant, str(policy)).result()
    sign_in(page, keyed)
    page.goto(f"{keyed.base_url}/console/policies")
    field = page.locator("#tenant")
    field.fill(tenant)
    field.press("Enter")
    deadline = time.monotonic() + 30  # the gateway follows conveyor.policies
    while "on, 120 s" not in page.locator("#effective").inner_text():
        assert time.monotonic() < deadline, page.content()
        page.wait_for_timeout(500)
        page.reload()
    assert "redacted: email" in page.locator("#effective").inner_text()
    assert f"tenant:{tenant}" in page.content()
    shot(page, "policies")


def test_a_worker_killed_shows_as_gone_and_then_back(keyed: Pipeline, page: Page) -> None:
    """Last in this file: it kills the keyed Conveyor's one worker (SIGKILL) and
    starts it again; the fleet page, left open, follows both by itself."""
    sign_in(page, keyed)
    page.goto(f"{keyed.base_url}/console/fleet")
    row = page.locator('tr[data-worker="w0"]')
    row.wait_for(timeout=30_000)
    assert "live" in (row.get_attribute("class") or "").split()
    keyed.kill("w0")
    page.wait_for_selector('tr[data-worker="w0"].gone', timeout=30_000)
    keyed.respawn("w0")
    page.wait_for_selector('tr[data-worker="w0"].live', timeout=60_000)
