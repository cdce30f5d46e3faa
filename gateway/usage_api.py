"""Usage reports over HTTP, read from the ledger the accounting app keeps
(docs/api/feedback.md#usage): ``GET /v1/usage`` for the caller's own tenant,
``GET /admin/usage?tenant=T`` for a holder of ``CONVEYOR_ADMIN_TOKEN`` (404
without one configured). Buckets of ``1m`` or ``1d``, oldest first, and
(unless ``key_id`` is given) the ratings by UTC day."""

from __future__ import annotations

import hmac
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from starlette.requests import HTTPConnection

from conveyor.errors import InvalidApiKey, InvalidRequest, RequestError
from gateway.auth.middleware import identity_of
from gateway.errors import SafeJSONResponse
from gateway.services import service, services_of
from workers.usage.ledger import UsageLedger, UsageRow

__all__ = ["usage_router"]

usage_router = APIRouter()


Ledger = Annotated[UsageLedger, Depends(service("usage"))]


async def _admin_token(connection: HTTPConnection) -> str:
    """The operator's token (``CONVEYOR_ADMIN_TOKEN``); empty: no admin endpoint."""
    token: str = services_of(connection).settings.auth.admin_token.get_secret_value()
    return token


_WIDTHS: dict[str, tuple[Literal["minute", "day"], int]] = {
    "1m": ("minute", 60_000), "1d": ("day", 86_400_000)}
_DEFAULT_SPAN_MS = {"1m": 3_600_000, "1d": 30 * 86_400_000}


@usage_router.get("/v1/usage")
async def own_usage(request: Request, ledger: Ledger,
                    start_time: int | None = None, end_time: int | None = None,
                    bucket_width: str = "1d", key_id: str | None = None, model: str | None = None
                    ) -> SafeJSONResponse:
    identity = identity_of(request)
    return await _report(ledger, identity.tenant, start_time, end_time, bucket_width,
                         key_id, model)


@usage_router.get("/admin/usage", include_in_schema=False)
async def admin_usage(request: Request, ledger: Ledger,
                      token: Annotated[str, Depends(_admin_token)], tenant: str,
                      start_time: int | None = None, end_time: int | None = None,
                      bucket_width: str = "1d", key_id: str | None = None, model: str | None = None
                      ) -> SafeJSONResponse:
    if not token:
        raise RequestError("Not Found", status=404, type="invalid_request_error")
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise InvalidApiKey("This endpoint needs the admin token.")
    return await _report(ledger, tenant, start_time, end_time, bucket_width, key_id, model)


async def _report(ledger: UsageLedger, tenant: str, start_time: int | None,
                  end_time: int | None, bucket_width: str, key_id: str | None,
                  model: str | None) -> SafeJSONResponse:
    if bucket_width not in _WIDTHS:
        raise InvalidRequest("bucket_width must be 1m or 1d.", param="bucket_width")
    by, width_ms = _WIDTHS[bucket_width]
    until_ms = end_time * 1000 if end_time is not None else int(time.time() * 1000)
    since_ms = start_time * 1000 if start_time is not None else \
        until_ms - _DEFAULT_SPAN_MS[bucket_width]
    if since_ms >= until_ms:
        raise InvalidRequest("start_time must be before end_time.", param="start_time")
    rows = await ledger.report(tenant, since_ms=since_ms, until_ms=until_ms, by=by,
                               key_id=key_id, model=model)
    out: dict[str, Any] = {"object": "list", "tenant": tenant, "bucket_width": bucket_width,
                           "data": [_bucket(row, width_ms) for row in rows]}
    if key_id is None:  # ratings are the tenant's, per model and deployment, not per key
        days = await ledger.ratings(tenant, since_ms=since_ms, until_ms=until_ms, model=model)
        out["ratings"] = [{"object": "ratings", "start_time": d.bucket_start_ms // 1000,
                           "end_time": (d.bucket_start_ms + 86_400_000) // 1000,
                           "count": d.count, "mean": d.mean, "by_model": d.by_model,
                           "by_deployment": d.by_deployment} for d in days]
    return SafeJSONResponse(out)


def _bucket(row: UsageRow, width_ms: int) -> dict[str, Any]:
    return {"object": "bucket", "start_time": row.bucket_start_ms // 1000,
            "end_time": (row.bucket_start_ms + width_ms) // 1000, "requests": row.requests,
            "errors": row.errors, "prompt_tokens": row.prompt_tokens,
            "completion_tokens": row.completion_tokens, "total_tokens": row.total_tokens}
