"""The console in a real browser (Debian's chromium, driven by Playwright)
against a running Conveyor: each page loads with no console error, the fleet
shows the workers, and a request sent through the API opens, from the
keyboard, as its journey through every layer; an API key made in the page
works on the API and, revoked in the page, stops working; a dead letter is
listed, opened and its redrive answered. With CONVEYOR_CONSOLE_SHOTS set
to a folder, each page's screenshot is written there (the docs' pictures)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.support.auth import Replicas
from tests.support.pipeline import Pipeline, client
from topics.clients import make_producer
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
    assert page.url.endswith("/console/fleet")
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
    page.wait_for_url("**/console/fleet")


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
        aside.submit(asyncio.run, _produce_poison(pipeline, key)).result()
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


async def _produce_poison(p: Pipeline, key: str) -> None:
    producer = make_producer(p.settings.kafka)
    await producer.start()
    try:
        await producer.send_and_wait(p.settings.kafka.topic("requests"), b"\x00not an event",
                                     key=key.encode())
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


def test_a_worker_killed_shows_as_gone_and_then_back(keyed: Pipeline, page: Page) -> None:
    """Last in this file: it kills the keyed Conveyor's one worker (SIGKILL) and
    starts it again; the fleet page, left open, follows both by itself."""
    sign_in(page, keyed)
    row = page.locator('tr[data-worker="w0"]')
    row.wait_for(timeout=30_000)
    assert "live" in (row.get_attribute("class") or "").split()
    keyed.kill("w0")
    page.wait_for_selector('tr[data-worker="w0"].gone', timeout=30_000)
    keyed.respawn("w0")
    page.wait_for_selector('tr[data-worker="w0"].live', timeout=60_000)
