"""An engine that answers from a script instead of a model; it keeps the engine
contract and passes the contract tests, so pipeline tests run without a model.

* **Scripts.** ``echo``: the last user message of a chat (else the rendered
  prompt), or a completion's prompt. ``count``: counting on after the last
  number in that text (``"1, 2, 3,"`` -> ``" 4, 5, 6, ..."``), never ending.
  ``text``: one fixed text. The answer depends only on the script, the
  prompt, ``max_tokens``, ``stop`` and ``continuation`` (sampling is ignored).
* **Tokens.** A token is whitespace and the word after it (``\\s*\\S+``), one
  a piece; an answer that ends by itself ends with an empty piece of one token
  (the end-of-sequence token): ``n`` words end with ``"stop"`` only when
  ``max_tokens > n``. A stop string (looked for after the continuation) ends
  the answer just before it; the token it began in counts.
* **Continuation.** The answer goes on after the first piece boundary at or
  past ``len(continuation)``, so a retry of its own answer is exactly its rest.
* **Capacity and pace.** At most ``capacity`` generations hold a slot, the rest
  wait in order; each piece comes ``token_delay_ms`` after the one before;
  :meth:`close` ends running generations with an EngineError.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import AsyncGenerator, Iterator
from typing import Literal, get_args

from conveyor.errors import EngineError
from workers.infer.engines.base import Engine, GenerationRequest, Piece
from workers.stops import first_stop

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


class ScriptedEngine(Engine):
    """Serves ``capacity`` scripted answers at once (see the module notes)."""

    name = "scripted"
    # scripted text follows no format and has no logits
    constrains_output = decodes_tools = biases_logits = reports_logprobs = False

    def __init__(
        self,
        script: Script = "echo",
        text: str = DEFAULT_TEXT,
        capacity: int = 2,
        token_delay_ms: float = 0.0,
    ) -> None:
        if script not in SCRIPTS:
            raise ValueError(f"script must be one of {', '.join(SCRIPTS)}")
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if token_delay_ms < 0:
            raise ValueError("token_delay_ms must not be negative")
        self.capacity = capacity
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
        cut = first_stop("".join(taken), request.stop)
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
