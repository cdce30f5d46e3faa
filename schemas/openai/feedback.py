"""The body of ``POST /v1/feedback`` (gateway/feedback.py): a request's id, a
score from -1 (bad) to 1 (good), labels and a comment."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from schemas.openai.fields import STRICT, Text

__all__ = ["FeedbackBody"]


class FeedbackBody(BaseModel):
    model_config = STRICT

    request_id: Text = Field(min_length=1, max_length=160)
    score: float | int = Field(ge=-1, le=1)
    labels: list[Annotated[Text, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=16)
    comment: Text = Field(default="", max_length=4000)
