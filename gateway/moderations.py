"""``POST /v1/moderations``, answered in the gateway from the checks that block a
request's input (workers/policy_checks.py) under the caller's policy: each
list's category, and the classifier's score as ``harassment`` (flagged at the
policy's threshold, else 0.8). No model, no event: it asks about text."""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from conveyor.policy.classifier import CATEGORY, classifier
from conveyor.policy.rules import PolicyBook
from gateway.auth.middleware import identity_of
from gateway.errors import SafeJSONResponse
from gateway.services import service
from schemas.openai.moderations import ModerationBody, moderation_result

__all__ = ["FLAG_THRESHOLD", "moderations_router", "MODERATION_MODEL"]

moderations_router = APIRouter()


MODERATION_MODEL = "conveyor-policy"
# where no policy sets level 2's threshold, a moderation flags harassment from here
FLAG_THRESHOLD = 0.8


@moderations_router.post("/v1/moderations", response_model=None)
async def moderations(body: ModerationBody, request: Request,
                      policies: Annotated[PolicyBook, Depends(service("policies"))]
                      ) -> SafeJSONResponse:
    identity = identity_of(request)
    policy = policies.effective(identity.tenant, identity.key_id)
    terms, texts = policy.input_terms, body.texts()
    model = await asyncio.to_thread(classifier)
    scores = await asyncio.to_thread(model.scores, texts)
    threshold = policy.classifier if policy.classifier is not None else FLAG_THRESHOLD
    results = [moderation_result({m.category for m in terms.all(text)}
                                 | ({CATEGORY} if score >= threshold else set()),
                                 terms.categories, {CATEGORY: round(score, 6)})
               for text, score in zip(texts, scores, strict=True)]
    return SafeJSONResponse({"id": f"modr-{uuid.uuid4().hex}", "model": MODERATION_MODEL,
                             "results": results})
