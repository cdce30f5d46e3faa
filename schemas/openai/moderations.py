"""``POST /v1/moderations`` in OpenAI's shape (gateway/moderations.py): the
body, and the answer built from the level-1 checks of the caller's policy.

Every OpenAI category is always present (false, score 0), so the official
client reads any of them; a policy's own category (``custom``, say) is added
beside them. A level-1 check is certain: a category flagged by a list scores
1; ``harassment`` carries the level-2 classifier's score.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.openai.fields import Text

__all__ = ["MAX_INPUTS", "ModerationBody", "ModerationText", "OPENAI_CATEGORIES",
           "moderation_result"]

OPENAI_CATEGORIES = (
    "harassment", "harassment/threatening", "hate", "hate/threatening", "illicit",
    "illicit/violent", "self-harm", "self-harm/instructions", "self-harm/intent", "sexual",
    "sexual/minors", "violence", "violence/graphic",
)
MAX_INPUTS = 32
_MAX_CHARS = 64_000


class ModerationText(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Annotated[Text, Field(max_length=_MAX_CHARS)]


class ModerationBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: Annotated[Text, Field(max_length=_MAX_CHARS)] | list[
        Annotated[Text, Field(max_length=_MAX_CHARS)]] | list[ModerationText] = Field(
        description="a text, a list of texts, or text input objects (images are not read)")
    model: str | None = None

    @field_validator("input")
    @classmethod
    def _counted(cls, value: str | list[Any]) -> str | list[Any]:
        """Every input is read or the request is refused: never a silent cut."""
        if isinstance(value, list) and not 1 <= len(value) <= MAX_INPUTS:
            raise ValueError(f"input holds {len(value)} texts; from 1 to {MAX_INPUTS} "
                             "are allowed in one request")
        return value

    def texts(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input]
        return [t if isinstance(t, str) else t.text for t in self.input]


def moderation_result(flagged: set[str], known: tuple[str, ...],
                      scores: dict[str, float] | None = None) -> dict[str, Any]:
    """One result: ``flagged`` categories true, every other known one false;
    a list's match scores 1, a classifier's score is its own (``scores``)."""
    names = list(OPENAI_CATEGORIES) + [c for c in known if c not in OPENAI_CATEGORIES]
    given = scores or {}
    return {
        "flagged": bool(flagged),
        "categories": {name: name in flagged for name in names},
        "category_scores": {name: max(given.get(name, 0.0), 1.0 if name in flagged else 0.0)
                            for name in names},
        "category_applied_input_types": {name: ["text"] for name in names},
    }
