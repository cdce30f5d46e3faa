"""Level 2 of the content policy: a classifier of abusive language.

The model is ``alt-profanity-check``'s: a linear SVM over TF-IDF features,
trained on about 200,000 labelled comments, shipped inside its PyPI wheel
(0.9 MB of weights, scikit-learn's), so nothing is fetched at run time. It
gives the probability that a text is profane or abusive, which Conveyor
reports under OpenAI's ``harassment`` category.

* **What it is good for**: insults and profanity, in English, whatever the
  words a tenant thought to list. **What it misses**: anything polite
  (instructions for harm, self-harm, sexual content without crude words),
  other languages, context beyond the text. It complements the lists (level
  1), it does not replace them.
* **Cost**: it loads (scikit-learn, SciPy) on the first request whose policy
  asks for it; a text costs milliseconds of CPU, so preprocess runs it in a
  worker thread (docs/decisions/0017-safety-in-levels.md).
* **Threshold**: the policy's ``[safety] classifier`` (0 to 1); a text
  scoring at or above it is blocked.
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
