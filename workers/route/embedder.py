"""Sentences to unit vectors in the route layer, with the fleet's embedding
model's own files and forward pass (workers/infer/engines/bert.py), loaded on
first use: only a process that routes or caches by meaning ever loads it. Why
route embeds for itself rather than asking the pipeline:
docs/decisions/0035-routing-by-meaning.md.

A text is embedded alone (a batch of one), its tokens cut to the model's
length: the same text gives the same vector every time, so a replayed
decision is the recorded one. Vectors are kept by the text's digest
(bounded; no prompt's text is kept), so a route's examples are embedded once.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from conveyor.errors import ConveyorError
from conveyor.registry import ModelSpec

if TYPE_CHECKING:
    import numpy as np
    from tokenizers import Tokenizer

    from workers.infer.engines.bert import BertEncoder

__all__ = ["Embedder", "Embedders", "EncoderUnavailable"]

# texts whose vectors are kept (each 1.5 KB for 384 dimensions)
_KEPT = 4096
# after a failed load, how long the model is not tried again
_RETRY_S = 60.0


class EncoderUnavailable(ConveyorError):
    """The embedding model's files could not be loaded (missing, unreadable,
    not a BERT): its callers go on without meaning."""


class Embedder:
    """One embedding model's sentence vectors; thread-safe."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._model: tuple[BertEncoder, Tokenizer] | None = None
        self._kept: OrderedDict[bytes, np.ndarray] = OrderedDict()  # by the text's digest
        self._examples: OrderedDict[bytes, np.ndarray] = OrderedDict()  # routes' examples
        self._lock = threading.Lock()
        self._failed: tuple[float, str] | None = None  # when, and why

    def _load(self) -> tuple[BertEncoder, Tokenizer]:
        with self._lock:
            if self._model is None:
                if self._failed is not None and time.monotonic() - self._failed[0] < _RETRY_S:
                    raise EncoderUnavailable(self._failed[1])
                from workers.infer.engines.bert import load_encoder

                try:  # one BLAS thread, as the encoder engine runs
                    self._model = load_encoder(self.spec.weights or "", 1)
                except Exception as exc:  # whatever the files hold: no meaning, not a 500
                    why = f"the encoder {self.spec.name} cannot be loaded: {exc!r}"
                    self._failed = (time.monotonic(), why)
                    raise EncoderUnavailable(why) from exc
            return self._model

    def _whole_ids(self, text: str) -> list[int]:
        """The text's token ids with [CLS] and [SEP], however many."""
        _, tokenizer = self._load()
        return list(tokenizer.encode(text, add_special_tokens=True).ids)

    def ids(self, text: str) -> list[int]:
        """The text's token ids with [CLS] and [SEP], cut to the model's length."""
        return self._cut(self._whole_ids(text))

    def _cut(self, ids: list[int]) -> list[int]:
        limit = self.spec.context_length
        return ids if len(ids) <= limit else [*ids[:limit - 1], ids[-1]]

    def vector(self, text: str, ids: list[int] | None = None, *,
               example: bool = False) -> np.ndarray:
        """The text's unit vector (float32), computed once while it is kept
        (from ``ids``, its token ids, when the caller has them). A route's
        ``example`` is kept apart from prompts, so that no run of prompts
        pushes an alias's examples out."""
        digest = _digest(text)
        kept_in = self._examples if example else self._kept
        with self._lock:
            kept = kept_in.get(digest)
            if kept is not None:
                kept_in.move_to_end(digest)
                return kept
        encoder, _ = self._load()
        vector = encoder.embed([self._cut(ids if ids is not None else self._whole_ids(text))])[0]
        vector.setflags(write=False)
        with self._lock:
            kept_in[digest] = vector
            while len(kept_in) > _KEPT:
                kept_in.popitem(last=False)
        return vector

    def forget(self, text: str) -> None:
        """Drop the text's kept vector (the next :meth:`vector` computes it)."""
        with self._lock:
            self._kept.pop(_digest(text), None)
            self._examples.pop(_digest(text), None)

    def whole_vector(self, text: str) -> np.ndarray | None:
        """:meth:`vector`, or None when the text is longer than the model reads."""
        ids = self._whole_ids(text)
        return None if len(ids) > self.spec.context_length else self.vector(text, ids)


class Embedders:
    """The embedders a process made, one per embedding model (by its name and
    weights: a registry change that moves the files makes a new one)."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, str, int], Embedder] = {}
        self._lock = threading.Lock()  # asked from the event loop and from threads

    def get(self, spec: ModelSpec) -> Embedder:
        key = (spec.name, spec.weights or "", spec.context_length)
        with self._lock:
            made = self._made.get(key)
            if made is None:
                made = self._made[key] = Embedder(spec)
            return made


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
