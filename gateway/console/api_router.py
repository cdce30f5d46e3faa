"""The console's pages (decision 0033): server-rendered from what the CLI reads
(:mod:`workers.fleet`, :mod:`workers.journey`, :mod:`topics.groups`,
:mod:`workers.replay`) and what the accounting app indexes
(:mod:`workers.usage.requests`, the ledger's model minutes), behind
:mod:`.access`. Live parts are fragments ``static/console.js`` fetches again
every few seconds."""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from conveyor.errors import BrokerError, InvalidRequest, RequestError, last_line
from conveyor.redis_clients import REDIS_ERRORS
from gateway.auth.keys import KeyNotFound, KeyStore
from gateway.auth.types import Limits
from gateway.console.access import (
    COOKIE,
    CSRF_COOKIE,
    SESSION_S,
    access,
    csrf_token,
    forged,
    same_origin,
    session_value,
)
from gateway.console.charts import (
    minute_starts,
    model_charts,
    prefix_hits_by_pool,
    routing_by_model,
)
from gateway.dead_letters import check, read_letters, redrive, redriven
from gateway.errors import BACKEND_ERRORS
from gateway.services import Services, services_of
from schemas.codec import default_codec
from topics.catalog import REQUESTS
from topics.envelope import iso, now_ms
from topics.lookup import parse_since
from topics.reader import decoded
from workers.journey import LAYERS, find_journey, report
from workers.replay import REPLAYABLE, ReplayError, parse_through, replay_request
from workers.replay import report as replay_report
from workers.usage.ledger import ReportBy

__all__ = ["console_router", "console_static"]

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
templates = Jinja2Templates(directory=_HERE / "templates")
templates.env.filters["iso"] = iso
templates.env.filters["text"] = lambda raw: (raw or b"").decode("utf-8", "replace")
console_router = APIRouter(prefix="/console", include_in_schema=False)
console_static = StaticFiles(directory=_HERE / "static")
# how far back a request id is looked for
_SINCE_MS = 7 * 86_400_000


def _refusal(request: Request) -> Response | None:
    """None for an operator who may see the console; else a sign-in or a 404."""
    allowed = access(request, services_of(request).settings)
    if allowed == "closed":
        return HTMLResponse("Not Found", status_code=404)
    if allowed == "sign-in":
        return RedirectResponse("/console/signin", status_code=303)
    return None


Route = Callable[..., Awaitable[Response]]
# Kafka or Redis not answering: their clients' errors, and Conveyor's for them
_UNREACHABLE: tuple[type[Exception], ...] = (*BACKEND_ERRORS, BrokerError)


def _operator(route: Route) -> Route:
    """A page only the operator opens (:func:`_refusal` for anyone else); a POST
    also needs the operator's origin and form token (403). A request or an
    unreachable Kafka or Redis the page needed is answered as a page saying so."""

    @functools.wraps(route)
    async def guarded(**kwargs: Any) -> Response:
        request: Request = kwargs["request"]
        refused = _refusal(request)
        if refused is None and request.method == "POST" and forged(request, kwargs["csrf"]):
            refused = HTMLResponse("Forbidden", status_code=403)
        if refused is not None:
            return refused
        try:
            return await route(**kwargs)
        except RequestError as exc:
            return _page(request, "unavailable.html", status_code=exc.status,
                         problem=exc.message)
        except _UNREACHABLE as exc:
            log.warning("console %s: %r", request.url.path, exc)
            return _page(request, "unavailable.html", status_code=503,
                         problem="Kafka or Redis does not answer; try again shortly.")

    return guarded


def _page(request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
    """``name`` rendered (for an operator: the routes are :func:`_operator`'s)."""
    _, health = services_of(request).health.report()
    troubled = {name: part for name, part in health["tasks"].items()
                if part.get("state") not in ("ok", None)}
    csrf = csrf_token(request)
    page = templates.TemplateResponse(request, name, {"health": health, "troubled": troubled,
                                                      "csrf": csrf, **context},
                                      status_code=status_code)
    if request.cookies.get(CSRF_COOKIE) != csrf:
        page.set_cookie(CSRF_COOKIE, csrf, path="/console", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    return page


@console_router.get("")
async def index() -> Response:
    return RedirectResponse("/console/overview", status_code=303)


@console_router.get("/signin")
async def signin_form(request: Request) -> Response:
    services = services_of(request)
    if not services.settings.auth.admin_token.get_secret_value():
        return RedirectResponse("/console/overview", status_code=303)
    return templates.TemplateResponse(request, "signin.html", {"refused": False})


@console_router.post("/signin")
async def signin(request: Request, token: str = Form("")) -> Response:
    services = services_of(request)
    admin = services.settings.auth.admin_token.get_secret_value()
    if not admin or not same_origin(request):
        return HTMLResponse("Forbidden", status_code=403)
    if not hmac.compare_digest(token.encode(), admin.encode()):
        return templates.TemplateResponse(request, "signin.html", {"refused": True},
                                          status_code=401)
    answer = RedirectResponse("/console/overview", status_code=303)
    answer.set_cookie(COOKIE, session_value(admin), max_age=SESSION_S, path="/console",
                      httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return answer


@console_router.post("/signout")
async def signout(request: Request) -> Response:
    if not same_origin(request):
        return HTMLResponse("Forbidden", status_code=403)
    answer = RedirectResponse("/console/signin", status_code=303)
    answer.delete_cookie(COOKIE, path="/console")
    return answer


def _fleet(services: Services) -> dict[str, Any]:
    fleet = services.fleet
    return {"rows": fleet.rows(), "read": fleet.read_yet}


@console_router.get("/fleet")
@_operator
async def fleet_page(request: Request) -> Response:
    return _page(request, "fleet.html", page="fleet", **_fleet(services_of(request)))


@console_router.get("/fleet/rows")
@_operator
async def fleet_rows(request: Request) -> Response:
    return _page(request, "fleet_rows.html", **_fleet(services_of(request)))


_LATELY_MS = 15 * 60_000
_LATELY_ROWS = 1_000


@console_router.get("/fleet/routing")
@_operator
async def fleet_routing(request: Request) -> Response:
    """Routing lately: each model's requests of the last minutes as the request
    index has them (how many ended in which error: refusals for want of room
    or a worker among them), and each pool's prefix hits as its workers count
    them."""
    services = services_of(request)
    found = await services.requests.search(since_ms=now_ms() - _LATELY_MS,
                                           limit=_LATELY_ROWS)
    return _page(request, "routing.html", models=routing_by_model(found.rows),
                 pools=prefix_hits_by_pool(services.fleet.rows()), more=found.more,
                 minutes=_LATELY_MS // 60_000, cap=_LATELY_ROWS)


# -- overview -----------------------------------------------------------------------

_CHART_MINUTES = 60


def _minute(ms: int) -> str:
    return iso(ms)[11:16]  # HH:MM, UTC


async def _charts(services: Services) -> dict[str, Any]:
    until = now_ms()
    starts = minute_starts(until, _CHART_MINUTES)
    minutes = await services.usage.model_minutes(since_ms=starts[0], until_ms=until)
    return {"models": model_charts(minutes, starts, _minute), "since": starts[0]}


@console_router.get("/overview")
@_operator
async def overview_page(request: Request) -> Response:
    services = services_of(request)
    groups = await services.groups.describe()
    return _page(request, "overview.html", page="overview", groups=groups,
                 **await _charts(services))


@console_router.get("/overview/pipeline")
@_operator
async def overview_pipeline(request: Request) -> Response:
    groups = await services_of(request).groups.describe()
    return _page(request, "pipeline.html", groups=groups)


@console_router.get("/overview/charts")
@_operator
async def overview_charts(request: Request) -> Response:
    return _page(request, "charts.html", **await _charts(services_of(request)))


# -- requests -----------------------------------------------------------------------

_STATUSES = ("completed", "error")


async def _found(request: Request, tenant: str, key_id: str, model: str, status: str,
                 since: str, until: str) -> dict[str, Any]:
    """The index's requests that match (newest first); a ``since`` or ``until``
    that does not read is a RequestError (the page says so)."""
    times: dict[str, int | None] = {}
    for name, value in (("since", since), ("until", until)):
        try:
            times[name] = parse_since(value) if value.strip() else None
        except ValueError as exc:
            raise InvalidRequest(str(exc), param=name) from exc
    found = await services_of(request).requests.search(
        tenant=tenant.strip() or None, key_id=key_id.strip() or None,
        model=model.strip() or None, status=status.strip() or None,
        since_ms=times["since"], until_ms=times["until"])
    filters = {"tenant": tenant, "key_id": key_id, "model": model, "status": status,
               "since": since, "until": until}
    query = urlencode({k: v for k, v in filters.items() if v.strip()})
    return {"found": found, "query": query, "filters": filters}


@console_router.get("/requests")
@_operator
async def requests_page(request: Request, id: str = "", tenant: str = "", key_id: str = "",
                        model: str = "", status: str = "", since: str = "",
                        until: str = "") -> Response:
    if id.strip():
        return RedirectResponse(f"/console/requests/{quote(id.strip())}", status_code=303)
    return _page(request, "requests.html", page="requests", statuses=_STATUSES,
                 **await _found(request, tenant, key_id, model, status, since, until))


@console_router.get("/requests/rows")
@_operator
async def requests_rows(request: Request, tenant: str = "", key_id: str = "", model: str = "",
                        status: str = "", since: str = "", until: str = "") -> Response:
    return _page(request, "requests_rows.html",
                 **await _found(request, tenant, key_id, model, status, since, until))


# how long after its end a request's events are still looked for (a late dead letter)
_AFTER_END_MS = 10_000


async def _ended(services: Services, request_id: str) -> int | None:
    """When the request ended, from the request index (None when not indexed,
    or when Redis does not answer: the journey is read to the deadline)."""
    try:
        row = await services.requests.get(request_id)
    except REDIS_ERRORS:
        return None
    return row.finished_ms + _AFTER_END_MS if row is not None else None


# what a replay from the page may run (conveyor replay --through): layers in a row
_THROUGH = ("preprocess,route", *REPLAYABLE)


_ARRIVING = 20


@console_router.get("/requests/arriving")
@_operator
async def requests_arriving(request: Request) -> Response:
    """The requests that came last, as the gateways wrote them to
    ``conveyor.requests``, each with its outcome once the index has it."""
    services = services_of(request)
    records = await services.lookup.last(REQUESTS.at(services.settings.kafka), _ARRIVING)
    arrived = sorted(decoded(REQUESTS, default_codec(), records, lambda r, exc: None),
                     key=lambda pair: pair[0].timestamp, reverse=True)[:_ARRIVING]
    rows = await services.requests.rows([event["envelope"]["request_id"]
                                         for _, event in arrived])
    return _page(request, "arriving.html", arrived=[
        (record.timestamp, event, row) for (record, event), row in zip(arrived, rows,
                                                                      strict=True)])


def _resume_url(rep: dict[str, Any]) -> str:
    """Where the request's tenant reads its stream again, from its first event."""
    route = "completions" if rep.get("kind") == "completion" else "chat/completions"
    return f"/v1/{route}/{rep['request_id']}/stream"


@console_router.get("/requests/{request_id}")
@_operator
async def request_page(request: Request, request_id: str, content: bool = False) -> Response:
    services = services_of(request)
    journey = await find_journey(services.settings, request_id, now_ms() - _SINCE_MS,
                                 ended_ms=await _ended(services, request_id))
    if journey is None:
        return _page(request, "requests.html", status_code=404, page="requests",
                     statuses=_STATUSES, found=None, query="", filters={},
                     missing=request_id)
    rep = report(journey, show_content=content)
    total = max((s["at_ms"] for s in rep["waterfall"]), default=0.0) or 1.0
    return _page(request, "request.html", page="requests", rep=rep, total=total,
                 layers=LAYERS, content=content, resume=_resume_url(rep),
                 replayable=_THROUGH)


@console_router.post("/requests/{request_id}/replay")
@_operator
async def replay_page(request: Request, request_id: str, through: str = Form("preprocess"),
                      content: bool = Form(False), csrf: str = Form("")) -> Response:
    settings = services_of(request).settings
    try:
        names = parse_through(through)
        rep = await replay_request(settings, request_id, names, now_ms() - _SINCE_MS)
    except (ValueError, ReplayError) as exc:
        raise InvalidRequest(str(exc), param="through") from exc
    if rep is None:
        return _page(request, "requests.html", status_code=404, page="requests",
                     statuses=_STATUSES, found=None, query="", filters={},
                     missing=request_id)
    return _page(request, "replay.html", page="requests",
                 rep=replay_report(rep, show_content=content), through=through)


# -- keys ---------------------------------------------------------------------------

def _keys(request: Request) -> KeyStore | None:
    """The gateway's key store (None unless ``CONVEYOR_AUTH=keys``)."""
    return services_of(request).authenticator.keys


def _actor(request: Request) -> str:
    return f"console@{services_of(request).health.gateway_id}"


@console_router.get("/keys")
@_operator
async def keys_page(request: Request, tenant: str = "") -> Response:
    keys = _keys(request)
    records = await keys.list(tenant.strip() or None) if keys is not None else []
    return _page(request, "keys.html", page="keys", keys_on=keys is not None,
                 records=records, tenant=tenant, now=now_ms())


@console_router.post("/keys")
@_operator
async def create_key(request: Request, tenant: str = Form(""), name: str = Form(""),
                     models: str = Form(""), csrf: str = Form("")) -> Response:
    keys = _keys(request)
    if keys is None:
        return HTMLResponse("Forbidden", status_code=403)
    try:
        record, secret = await keys.create(
            tenant.strip(), name.strip(), Limits(),
            models=tuple(m.strip() for m in models.split(",") if m.strip()),
            actor=_actor(request))
    except ValueError as exc:
        return _page(request, "keys.html", status_code=400, page="keys", keys_on=True,
                     records=await keys.list(), tenant="", now=now_ms(), problem=str(exc))
    return _page(request, "key_created.html", page="keys", record=record, secret=secret)


@console_router.get("/keys/{key_id}/revoke")
@_operator
async def revoke_form(request: Request, key_id: str) -> Response:
    keys = _keys(request)
    record = next((r for r in await keys.list() if r.id == key_id), None) \
        if keys is not None else None
    if record is None:
        return _page(request, "keys.html", status_code=404, page="keys", keys_on=keys is not None,
                     records=[], tenant="", now=now_ms(), problem=f"No key {key_id}.")
    return _page(request, "key_revoke.html", page="keys", record=record, now=now_ms())


@console_router.post("/keys/{key_id}/revoke")
@_operator
async def revoke_key(request: Request, key_id: str, csrf: str = Form("")) -> Response:
    keys = _keys(request)
    if keys is None:
        return HTMLResponse("Forbidden", status_code=403)
    try:
        await keys.revoke(key_id, actor=_actor(request))
    except KeyNotFound:
        return HTMLResponse("Not Found", status_code=404)
    return RedirectResponse("/console/keys", status_code=303)


# -- dead letters -------------------------------------------------------------------

@console_router.get("/dead-letters")
@_operator
async def letters_page(request: Request, since: str = "24h", layer: str = "") -> Response:
    settings = services_of(request).settings
    try:
        since_ms = parse_since(since)
    except ValueError as exc:
        return _page(request, "dead_letters.html", status_code=400, page="dead-letters",
                     letters=[], sent={}, since=since, layer=layer, problem=str(exc))
    letters = [x for x in await read_letters(settings, since_ms)
               if not layer or x.letter["layer"] == layer]
    sent = await redriven(settings, since_ms) if letters else {}
    return _page(request, "dead_letters.html", page="dead-letters", letters=letters, sent=sent,
                 since=since, layer=layer, last_line=last_line)


@console_router.get("/dead-letters/{offset}")
@_operator
async def letter_page(request: Request, offset: int) -> Response:
    settings = services_of(request).settings
    found = await read_letters(settings, 0, [offset])
    if not found:
        return _page(request, "dead_letters.html", status_code=404, page="dead-letters",
                     letters=[], sent={}, since="24h", layer="",
                     problem=f"No dead letter at offset {offset}.")
    letter = found[0]
    sent = (await redriven(settings, letter.letter["ts_ms"])).get(offset)
    return _page(request, "dead_letter.html", page="dead-letters", x=letter, sent=sent,
                 problem=check(settings, default_codec(), letter.letter))


@console_router.post("/dead-letters/{offset}/redrive")
@_operator
async def redrive_letter(request: Request, offset: int, csrf: str = Form("")) -> Response:
    settings = services_of(request).settings
    found = await read_letters(settings, 0, [offset])
    if not found:
        return HTMLResponse("Not Found", status_code=404)
    [result] = await redrive(settings, found, _actor(request))
    key = found[0].letter["key"]
    return _page(request, "redriven.html", page="dead-letters", result=result,
                 request_id=key.decode(errors="replace") if key else None)


# -- usage --------------------------------------------------------------------------

_SPANS: dict[str, tuple[ReportBy, int]] = {"hour": ("minute", 3_600_000),
                                           "day": ("minute", 86_400_000),
                                           "month": ("day", 30 * 86_400_000)}


@console_router.get("/usage")
@_operator
async def usage_page(request: Request, tenant: str = "", span: str = "day", key_id: str = "",
                     model: str = "") -> Response:
    context: dict[str, Any] = {"page": "usage", "tenant": tenant, "span": span,
                               "key_id": key_id, "model": model, "rows": [], "ratings": [],
                               "spans": list(_SPANS)}
    if not tenant.strip():
        return _page(request, "usage.html", **context)
    by, width = _SPANS.get(span, _SPANS["day"])
    ledger = services_of(request).usage
    until = now_ms()
    rows = await ledger.report(tenant.strip(), since_ms=until - width, until_ms=until, by=by,
                               key_id=key_id.strip() or None, model=model.strip() or None)
    ratings = [] if key_id.strip() else await ledger.ratings(
        tenant.strip(), since_ms=until - width, until_ms=until, model=model.strip() or None)
    top = max((r.requests for r in rows), default=0) or 1
    return _page(request, "usage.html", **{**context, "rows": rows, "ratings": ratings,
                                           "top": top})


# -- policies -----------------------------------------------------------------------

@console_router.get("/policies")
@_operator
async def policies_page(request: Request, tenant: str = "", key_id: str = "") -> Response:
    book = services_of(request).policies  # followed live from conveyor.policies
    effective = book.effective(tenant.strip(), key_id.strip()).described() \
        if tenant.strip() else None
    return _page(request, "policies.html", page="policies", scopes=book.scopes(),
                 tenant=tenant, key_id=key_id, effective=effective)
