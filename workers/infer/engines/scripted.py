"""An engine that answers from a script instead of a model.

It keeps the engine contract (base.py) as the real engines do, and passes
the same contract tests (tests/engines/workers/infer/engines/test_contract.py), so a
test about the pipeline (delivery, resume, faults, the API) runs without
loading a model; only the tests about an engine run one.

Decisions:

* **Scripts.** ``echo`` answers with the request's own words: the last user
  message of a chat (or the rendered prompt when it has no messages), the
  prompt of a completion. ``count`` goes on counting after the last number
  in that text (``"1, 2, 3,"`` is answered ``" 4, 5, 6, ..."``) and never
  ends on its own, so an answer runs to ``max_tokens``: a long answer whose
  every piece shows whether a retry continued it or started over. ``text``
  answers every request with one fixed text.
* **Deterministic.** The answer depends on the script and the request's
  prompt or messages, ``max_tokens``, ``stop`` and ``continuation``, and
  on nothing else: ``temperature``, ``top_p`` and ``seed`` are ignored, so
  a request sampled at temperature 1 without a seed gets the same answer
  every time, and two different seeds get the same answer too.
* **Tokens.** A token is a run of whitespace and the word after it (the
  pattern ``\\s*\\S+``), so the pieces join back into the script's text.
  Each piece carries one token. An answer that ends by itself ends with an
  empty piece of one token, the end-of-script token, as llama.cpp and vLLM
  count the end-of-sequence token: an answer of ``n`` words needs
  ``max_tokens > n`` to end with ``"stop"``, and ends with ``"length"``
  after ``max_tokens`` words otherwise.
* **Stop strings** are looked for in the text after the continuation (as a
  real engine sees only the text it generates); the answer ends just before
  the first one, with ``"stop"``, and the token in which it began counts.
* **Continuation.** The answer continues after the first piece boundary at
  or past ``len(continuation)`` characters of the script's answer. A
  continuation this engine sent itself ends on a boundary, so a retried
  answer is exactly the rest of the uninterrupted one (``max_tokens`` is
  what remains, as ``request_from_task`` asks).
* **Capacity.** At most ``capacity`` generations hold a slot; more wait for
  one, in order. A slot is taken before the first piece and given back the
  moment the generation ends, is closed (``aclose()``) or its consumer is
  cancelled.
* **Pace.** Each piece, the last included, comes ``token_delay_ms`` after
  the one before (the first after that long too); with no delay each piece
  still yields to the event loop. :meth:`close` ends running generations
  with :class:`~conveyor.errors.EngineError` at their next piece.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncGenerator, Iterator
from typing import Literal, get_args

from conveyor.errors import EngineError
from workers.infer.engines.base import GenerationRequest, KvState, Piece

__all__ = ["SCRIPTS", "DEFAULT_TEXT", "Script", "ScriptedEngine", "pieces_of"]

Script = Literal["echo", "count", "text"]
SCRIPTS: tuple[Script, ...] = get_args(Script)
DEFAULT_TEXT = (
    "Conveyor answers this from a script: every request gets the same words, "
    "one token at a time, so a test can tell a continued answer from a new one."
)

_PIECE = re.compile(r"\s*\S+|\s+")
_NUMBER = re.compile(r"\d+")


def pieces_of(text: str) -> list[str]:
    """``text`` cut into the scripted engine's tokens; they join back into it."""
    return _PIECE.findall(text)


class ScriptedEngine:
    """Serves ``capacity`` scripted answers at once (see the module notes)."""

    def __init__(
        self,
        script: Script = "echo",
        text: str = DEFAULT_TEXT,
        capacity: int = 2,
        token_delay_ms: float = 0.0,
        name: str = "scripted",
    ) -> None:
        if script not in SCRIPTS:
            raise ValueError(f"script must be one of {', '.join(SCRIPTS)}")
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if token_delay_ms < 0:
            raise ValueError("token_delay_ms must not be negative")
        self.name = name
        self.capacity = capacity
        self.constrains_output = False  # scripted text follows no format
        self.decodes_tools = False
        self.biases_logits = False  # scripted text has no logits
        self.reports_logprobs = False
        # the pool's models, all of them loaded (base.Engine)
        self.served: list[str] | None = None
        self.loaded: list[str] | None = None
        self.script = script
        self.text = text
        self.token_delay_s = token_delay_ms / 1000
        self._slots: asyncio.Semaphore | None = None
        self._live: set[asyncio.Event] = set()  # one cancel flag per generation
        self._running = 0

    @property
    def running(self) -> int:
        """Generations holding a slot now."""
        return self._running

    async def start(self) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity)

    def answer(self, request: GenerationRequest) -> Iterator[str]:
        """The script's whole answer to ``request``, token by token, before the
        continuation, ``max_tokens`` and stop strings apply (``count`` never ends)."""
        if self.script == "text":
            return iter(pieces_of(self.text))
        source = _source(request)
        if self.script == "echo":
            return iter(pieces_of(source))
        numbers = _NUMBER.findall(source)
        start = int(numbers[-1]) + 1 if numbers else 1
        return (f" {n}," for n in itertools.count(start))

    def plan(self, request: GenerationRequest) -> list[Piece]:
        """The pieces :meth:`generate` sends for ``request``, the last with its
        finish reason."""
        rest = _after(self.answer(request), len(request.continuation))
        budget = max(1, request.max_tokens)
        taken = list(itertools.islice(rest, budget))
        cut = _first_stop("".join(taken), request.stop)
        if cut is not None:
            pieces: list[Piece] = []
            at = 0
            for text in taken:
                if at + len(text) > cut:  # the stop string begins in this token
                    return [*pieces, Piece(text[: cut - at], finish_reason="stop")]
                pieces.append(Piece(text))
                at += len(text)
        if len(taken) < budget:  # the script ended: its end token fits
            return [*(Piece(text) for text in taken), Piece("", finish_reason="stop")]
        *body, last = taken
        return [*(Piece(text) for text in body), Piece(last, finish_reason="length")]

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        """Stream the planned pieces from a free slot (see the module notes)."""
        slots = self._slots
        if slots is None:
            raise EngineError(f"engine {self.name} is not started")
        pieces = self.plan(request)
        cancelled = asyncio.Event()
        self._live.add(cancelled)
        try:
            async with slots:
                self._running += 1
                try:
                    for piece in pieces:
                        await asyncio.sleep(self.token_delay_s)
                        if cancelled.is_set():
                            raise EngineError("the generation was cancelled")
                        yield piece
                finally:
                    self._running -= 1
        finally:
            self._live.discard(cancelled)

    def kv_state(self) -> KvState | None:
        return None  # no KV cache the worker can see (see base.Engine)

    async def close(self) -> None:
        """End what runs (at its next piece) and refuse new generations."""
        for cancelled in self._live:
            cancelled.set()
        self._slots = None


def _source(request: GenerationRequest) -> str:
    """The text ``echo`` repeats and ``count`` counts on from."""
    if request.kind == "chat" and request.messages:
        users = [m["content"] for m in request.messages if m["role"] == "user"]
        return users[-1] if users else request.messages[-1]["content"]
    return request.prompt_text or ""


def _after(pieces: Iterator[str], chars: int) -> Iterator[str]:
    """The pieces after the first boundary at or past ``chars`` characters."""
    consumed = 0
    while consumed < chars:
        piece = next(pieces, None)
        if piece is None:
            return iter(())
        consumed += len(piece)
    return pieces


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string in ``text`` begins, or None."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None
