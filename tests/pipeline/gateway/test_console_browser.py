"""The console in a real browser (Debian's chromium, driven by Playwright)
against a running Conveyor: each page loads with no console error, the fleet
shows the workers, and a request sent through the API opens, from the
keyboard, as its journey through every layer. With CONVEYOR_CONSOLE_SHOTS set
to a folder, each page's screenshot is written there (the docs' pictures)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.support.pipeline import Pipeline, client
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
    page.keyboard.type(rid)  # the id's field has the focus
    page.keyboard.press("Enter")
    page.wait_for_url(f"**/console/requests/{rid}", timeout=30_000)
    for step in (*LAYERS, "reply"):
        assert page.locator(f'tr[data-step="{step}"]').count() == 1, step
    assert word not in page.content()
    shot(page, "request")
    page.get_by_role("link", name="Show the prompt and the answer").click()
    page.wait_for_url("**content=1")
    assert word in page.locator("pre.prompt").inner_text()
