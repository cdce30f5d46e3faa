"""Level 2 of the content policy: ``alt-profanity-check``'s classifier of
abusive language (a linear SVM shipped in its wheel, nothing fetched), its
score reported under OpenAI's ``harassment`` category; loaded on first use.
What it catches, misses and costs: docs/decisions/0017-safety-in-levels.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CATEGORY", "Classifier", "classifier"]

CATEGORY = "harassment"

_lock = threading.Lock()
_loaded: Classifier | None = None


class Classifier:
    """The probability that each text is abusive, from the packaged model."""

    def __init__(self, predict: Callable[[Sequence[str]], Any]) -> None:
        self._predict = predict

    def scores(self, texts: Sequence[str]) -> list[float]:
        if not texts:
            return []
        return [float(p) for p in self._predict(list(texts))]

    def score(self, text: str) -> float:
        return self.scores([text])[0]


def classifier() -> Classifier:
    """The process's classifier, loaded on first use (about 1 s)."""
    global _loaded
    with _lock:
        if _loaded is None:
            from profanity_check import predict_prob

            _loaded = Classifier(predict_prob)
        return _loaded
