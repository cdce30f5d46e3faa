"""The console's door and pages, on an application whose lifespan does not run:
who may open it (an admin token's session, or loopback with auth off), forms
only from its own origin, and the fleet as the heartbeats tell."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor.policy.rules import tenant_scope
from conveyor.settings import AuthSettings, Settings, load_settings
from gateway.app import build_app
from gateway.console.access import COOKIE, CSRF_COOKIE, forged, session_value
from tests.support.gateway_fakes import offline_services
from tests.support.schedule_tasks import beat

TOKEN = "operator-token-of-the-console-tests"


def console(settings: Settings, client: tuple[str, int] = ("127.0.0.1", 40000),
            base_url: str = "http://127.0.0.1:8000") -> httpx.AsyncClient:
    """The console of a gateway with ``settings`` (its other services offline,
    made with auth off: the console reads only the settings' auth)."""
    app = build_app(settings)
    offline = offline_services(settings.model_copy(update={"auth": AuthSettings()}))
    app.state.services = dataclasses.replace(offline, settings=settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=client),
                             base_url=base_url)


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with console(load_settings(files_dir=tmp_path)) as http:
        yield http


async def test_with_auth_off_a_loopback_client_opens_it(local: httpx.AsyncClient) -> None:
    r = await local.get("/console")
    assert r.status_code == 303 and r.headers["location"] == "/console/overview"
    page = await local.get("/console/fleet")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'data-live="/console/fleet/rows"' in page.text
    assert (await local.get("/console/static/console.js")).status_code == 200


async def test_with_auth_off_nobody_else_opens_it(tmp_path: Path) -> None:
    settings = load_settings(files_dir=tmp_path)
    async with console(settings, client=("10.1.2.3", 5000)) as http:
        assert (await http.get("/console/fleet")).status_code == 404
    # a page of another site reaching the gateway through a name of its own
    async with console(settings, base_url="http://rebound.example:8000") as http:
        assert (await http.get("/console/fleet")).status_code == 404


async def test_with_auth_on_and_no_admin_token_it_is_not_served(tmp_path: Path) -> None:
    settings = load_settings(files_dir=tmp_path, auth="keys", auth_secret="s" * 32)
    async with console(settings) as http:
        assert (await http.get("/console/fleet")).status_code == 404


async def test_the_admin_token_signs_in_once_into_a_session(tmp_path: Path) -> None:
    settings = load_settings(files_dir=tmp_path, auth="keys", auth_secret="s" * 32,
                             admin_token=TOKEN)
    own = {"origin": "http://127.0.0.1:8000"}
    async with console(settings, client=("10.1.2.3", 5000)) as http:
        r = await http.get("/console/fleet", headers={"authorization": "Bearer sk-tenant"})
        assert r.status_code == 303 and r.headers["location"] == "/console/signin"
        assert (await http.get("/console/signin")).status_code == 200
        wrong = await http.post("/console/signin", data={"token": "sk-tenant"}, headers=own)
        assert wrong.status_code == 401 and COOKIE not in wrong.cookies
        elsewhere = await http.post("/console/signin", data={"token": TOKEN},
                                    headers={"origin": "http://evil.example"})
        assert elsewhere.status_code == 403
        r = await http.post("/console/signin", data={"token": TOKEN}, headers=own)
        assert r.status_code == 303
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and TOKEN not in cookie
        assert (await http.get("/console/fleet")).status_code == 200
        r = await http.post("/console/signout", headers=own)
        assert r.status_code == 303
        http.cookies.clear()
        assert (await http.get("/console/fleet")).status_code == 303


async def test_a_session_expires_and_a_forged_one_opens_nothing(tmp_path: Path) -> None:
    settings = load_settings(files_dir=tmp_path, admin_token=TOKEN)
    async with console(settings) as http:
        for value in (session_value(TOKEN, now=0), session_value("another-token"),
                      "99999999999.forged"):
            http.cookies.set(COOKIE, value)
            assert (await http.get("/console/fleet")).status_code == 303, value
        http.cookies.set(COOKIE, session_value(TOKEN))
        assert (await http.get("/console/fleet")).status_code == 200


async def test_the_fleet_shows_each_worker_as_its_heartbeat_tells(tmp_path: Path) -> None:
    settings = load_settings(files_dir=tmp_path)
    app = build_app(settings)
    services = offline_services(settings)
    app.state.services = services
    fleet: Any = services.fleet
    fleet.beats["w7"] = beat("w7", running=1, capacity=2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1:8000") as http:
        rows = await http.get("/console/fleet/rows")
    assert rows.status_code == 200
    assert 'data-worker="w7"' in rows.text and "1/2" in rows.text


async def test_keys_off_says_so_and_an_action_needs_its_form_s_token(
        local: httpx.AsyncClient) -> None:
    page = await local.get("/console/keys")
    assert page.status_code == 200 and "API keys are off" in page.text
    token = page.cookies[CSRF_COOKIE]
    assert f'value="{token}"' not in page.text  # no form is shown: keys are off
    own = {"origin": "http://127.0.0.1:8000"}
    # with keys off, creating one is refused whatever the form holds
    refused = await local.post("/console/keys", data={"tenant": "t", "csrf": token},
                               headers=own)
    assert refused.status_code == 403


def test_a_form_without_its_token_or_from_elsewhere_is_forged() -> None:
    from starlette.requests import Request

    def posted(origin: str, cookie: str) -> Request:
        headers = [(b"host", b"127.0.0.1:8000"), (b"origin", origin.encode())]
        if cookie:
            headers.append((b"cookie", f"{CSRF_COOKIE}={cookie}".encode()))
        return Request({"type": "http", "method": "POST", "scheme": "http", "path": "/console",
                        "server": ("127.0.0.1", 8000), "headers": headers, "query_string": b""})

    own = "http://127.0.0.1:8000"
    assert not forged(posted(own, "abc"), "abc")
    assert forged(posted(own, "abc"), "abd")
    assert forged(posted(own, ""), "")
    assert forged(posted("http://evil.example", "abc"), "abc")


async def test_usage_says_plainly_when_redis_does_not_answer(tmp_path: Path) -> None:
    settings = load_settings(files_dir=tmp_path, redis_url="redis://127.0.0.1:9/0")
    async with console(settings) as http:
        form = await http.get("/console/usage")
        assert form.status_code == 200 and 'name="tenant"' in form.text
        down = await http.get("/console/usage", params={"tenant": "acme"})
    assert down.status_code == 503 and "Redis does not answer" in down.text
    assert "text/html" in down.headers["content-type"]


async def test_kafka_down_and_bad_input_are_pages_that_say_so(tmp_path: Path) -> None:
    settings = load_settings(files_dir=tmp_path, kafka_bootstrap="127.0.0.1:9")
    async with console(settings) as http:
        journey = await http.get("/console/requests/01a2467c2d14aa1257e7f262095cdd34")
        letters = await http.get("/console/dead-letters")
        both = await http.get("/console/usage", params={"tenant": "acme", "key_id": "k",
                                                         "model": "m"})
    for page in (journey, letters):
        assert page.status_code == 503 and "Kafka or Redis does not answer" in page.text
    assert both.status_code == 400 and "give one of them" in both.text


async def test_the_policy_that_applies_to_a_tenant_is_shown(tmp_path: Path) -> None:
    settings = load_settings(files_dir=tmp_path)
    app = build_app(settings)
    services = offline_services(settings)
    app.state.services = services
    services.policies.set(tenant_scope("acme"), '[pii]\nredact = ["email"]\nrestore = true\n'
                          '\n[cache]\nenabled = true\nttl_s = 300\n')
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1:8000") as http:
        page = await http.get("/console/policies", params={"tenant": "acme"})
        other = await http.get("/console/policies", params={"tenant": "beta"})
    assert page.status_code == 200 and "tenant:acme" in page.text
    assert "redacted: email, restored in the answer" in page.text and "on, 300 s" in page.text
    assert "not redacted" in other.text and "Prompt cache</dt><dd>off" in other.text


async def test_the_overview_and_the_requests_say_so_when_kafka_and_redis_are_down(
        tmp_path: Path) -> None:
    settings = load_settings(files_dir=tmp_path, kafka_bootstrap="127.0.0.1:9",
                             redis_url="redis://127.0.0.1:9/0")
    async with console(settings) as http:
        pages = [await http.get(f"/console/{path}") for path in (
            "overview", "overview/pipeline", "overview/charts", "requests", "requests/rows",
            "requests/arriving")]
        bad = await http.get("/console/requests", params={"since": "the other day"})
    for page in pages:
        assert page.status_code == 503, page.url
        assert "Kafka or Redis does not answer" in page.text
    assert bad.status_code == 400 and "is not a date" in bad.text


async def test_a_replay_is_a_form_of_the_operator_s_own(local: httpx.AsyncClient) -> None:
    own = {"origin": "http://127.0.0.1:8000"}
    forged_one = await local.post("/console/requests/0123/replay",
                                  data={"through": "preprocess"}, headers=own)
    assert forged_one.status_code == 403
    page = await local.get("/console/fleet")
    token = page.cookies[CSRF_COOKIE]
    refused = await local.post("/console/requests/0123/replay", headers=own,
                               data={"through": "schedule", "csrf": token})
    assert refused.status_code == 400 and "schedule is not replayed" in refused.text
