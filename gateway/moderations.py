"""``POST /v1/moderations``: OpenAI's moderation endpoint, answered from the
same level-1 checks that block a request's input (workers/policy_checks.py),
under the caller's policy (its tenant's and key's lists on top of the
default). It runs in the gateway, with no model and no event: a moderation
is a question about text, not a request to the fleet. An input longer than
64,000 characters or more than 32 inputs is a 400 (the body's limits).
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from gateway.auth.middleware import identity_of
from gateway.errors import SafeJSONResponse
from gateway.serving import Serving
from schemas.openai.moderations import ModerationBody, moderation_result

__all__ = ["moderations_router", "MODERATION_MODEL"]

moderations_router = APIRouter()

MODERATION_MODEL = "conveyor-l1"


@moderations_router.post("/v1/moderations", response_model=None)
async def moderations(body: ModerationBody, request: Request) -> SafeJSONResponse:
    serving: Serving = request.app.state.serving
    identity = identity_of(request)
    terms = serving.policies.effective(identity.tenant, identity.key_id).input_terms
    results = [moderation_result({m.category for m in terms.all(text)}, terms.categories)
               for text in body.texts()]
    return SafeJSONResponse({"id": f"modr-{uuid.uuid4().hex}", "model": MODERATION_MODEL,
                             "results": results})
