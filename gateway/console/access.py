"""Who may open the console. With ``CONVEYOR_ADMIN_TOKEN`` set, the operator
signs in with it once and holds a signed, expiring session cookie (never the
token itself); a tenant's key never opens it. Without a token, the console
answers only a loopback client that named a loopback host (the local default,
auth off), and is not served at all where auth is on. A form's POST must come
from the console's own origin."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from typing import Literal

from starlette.requests import Request

from conveyor.settings import Settings

__all__ = ["COOKIE", "CSRF_COOKIE", "SESSION_S", "Access", "access", "csrf_token", "forged",
           "session_value", "same_origin"]

COOKIE = "conveyor_console"
# a form's token, also in this cookie: a page of another site can read neither
CSRF_COOKIE = "conveyor_console_csrf"
SESSION_S = 12 * 3600

Access = Literal["open", "sign-in", "closed"]


def _sign(token: str, expires: int) -> str:
    return hmac.new(token.encode(), f"console:{expires}".encode(), hashlib.sha256).hexdigest()


def session_value(token: str, now: float | None = None) -> str:
    """A session cookie's value: its expiry and its signature with the token."""
    expires = int((time.time() if now is None else now) + SESSION_S)
    return f"{expires}.{_sign(token, expires)}"


def _valid(token: str, value: str, now: float) -> bool:
    expires, _, signature = value.partition(".")
    if not expires.isdigit() or int(expires) < now:
        return False
    return hmac.compare_digest(signature, _sign(token, int(expires)))


def _loopback(host: str | None) -> bool:
    if host in ("localhost",):
        return True
    try:
        return host is not None and ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def access(request: Request, settings: Settings) -> Access:
    """``open``: serve the page; ``sign-in``: ask for the admin token; ``closed``:
    the console is not served to this caller (404)."""
    token = settings.auth.admin_token.get_secret_value()
    if token:
        value = request.cookies.get(COOKIE, "")
        return "open" if _valid(token, value, time.time()) else "sign-in"
    if settings.auth.mode != "none":
        return "closed"
    client = request.client.host if request.client else None
    host = request.url.hostname
    return "open" if _loopback(client) and _loopback(host) else "closed"


def same_origin(request: Request) -> bool:
    """Whether a form's POST came from a page of this gateway (its ``Origin``,
    or its ``Referer`` where a browser sends no origin)."""
    own = f"{request.url.scheme}://{request.url.netloc}"
    origin = request.headers.get("origin")
    if origin is not None:
        return origin == own
    referer = request.headers.get("referer", "")
    return referer == own or referer.startswith(own + "/")


def csrf_token(request: Request) -> str:
    """The token a form of this browser carries (its cookie's, or a new one)."""
    return request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(24)


def forged(request: Request, token: str) -> bool:
    """Whether an action's POST may not be the operator's own: from another
    origin, or without the token its browser was given."""
    cookie = request.cookies.get(CSRF_COOKIE, "")
    return not (same_origin(request) and cookie and hmac.compare_digest(cookie, token))
