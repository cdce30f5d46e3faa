"""Per-request state of postprocess: one small object per request in flight.

Chunks are applied in sequence order, one run's at each seq
(:class:`~workers.chunk_order.ChunkOrder`: early ones wait, repeats and
chunks of a second run are dropped);
stop sequences are matched across chunk boundaries by holding back the tail
that could still begin a stop sequence; the answer's safety check
(workers/policy_checks.py) holds back the tail a blocked term could begin.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from conveyor.policy.safety import Match, StreamScanner
from schemas.records import (
    ChunkHeader,
    Embedding,
    Envelope,
    ErrorInfo,
    TokenChunk,
    TokenLogprob,
)
from schemas.tool_calls import ToolCallReader
from topics.envelope import unstamped
from workers.chunk_order import ChunkOrder
from workers.prompt_cache import CACHE_WORKER
from workers.stops import first_stop, held_tail

__all__ = ["RequestStream", "Emitted"]


@dataclass
class Emitted:
    """What one applied chunk releases to the client."""

    text: str = ""
    finish_reason: str | None = None
    error: ErrorInfo | None = None
    # the stop sequence was met: the worker should stop generating
    stopped_early: bool = False
    # with logprobs asked for: the tokens of ``text``
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class RequestStream:
    envelope: Envelope
    header: ChunkHeader | None = None
    completion_tokens: int = 0
    # of the prompt's tokens, how many the engine's prefix cache held (the last run's)
    cached_tokens: int = 0
    reply_index: int = 0
    held: str = ""
    done: bool = False
    order: ChunkOrder = field(default_factory=ChunkOrder)
    # a job's request (no client streams it): its text, gathered for its result
    collected: list[str] = field(default_factory=list)
    # an answer read for tool calls (its header says so): the reader of its text
    tools: ToolCallReader | None = None
    # logprobs of tokens whose text is not released yet (held for a stop
    # sequence, or a token holding part of a character), and the bytes of
    # text released so far and of the tokens released so far
    pending: list[TokenLogprob] = field(default_factory=list)
    released_bytes: int = 0
    token_bytes: int = 0
    # the characters of the tokens whose logprobs were sent (completions' text_offset)
    logprob_chars: int = 0
    # a job's request: its tokens' logprobs, gathered for its result
    collected_logprobs: list[TokenLogprob] = field(default_factory=list)
    # the answer's safety check, where its policy has one, and what it caught
    scanner: StreamScanner | None = None
    filtered: Match | None = None
    # answered from the prompt cache (workers/prompt_cache.py), not by a worker
    from_cache: bool = False
    # when postprocess handled the first chunk with generated text (epoch ms;
    # the layer sets it): the usage record's time to first token
    first_token_ms: int | None = None
    # an embedding request: the inputs' vectors (a run writes them in its last chunk)
    embeddings: list[Embedding] = field(default_factory=list)

    @functools.cached_property
    def unstamped(self) -> Envelope:
        return unstamped(self.envelope)

    def take(self, chunk: TokenChunk) -> list[Emitted]:
        """Apply ``chunk`` and any that were waiting for it."""
        if self.done:
            return []
        out: list[Emitted] = []
        for ready in self.order.offer(chunk):
            if self.done:
                break
            out.append(self._apply(ready))
        return out

    def _apply(self, chunk: TokenChunk) -> Emitted:
        if chunk["header"] is not None and self.header is None:
            self.header = chunk["header"]
            self.from_cache = chunk["worker_id"] == CACHE_WORKER
        if chunk["error"] is not None:
            self.done = True
            return Emitted(error=chunk["error"])
        self.completion_tokens += chunk["tokens"]
        self.embeddings.extend(chunk.get("embeddings") or ())
        self.pending.extend(chunk.get("logprobs") or ())
        if chunk.get("cached_tokens") is not None:
            self.cached_tokens = chunk.get("cached_tokens") or 0
        stops = self.header["stop"] if self.header else []
        text = self.held + chunk["text"]
        self.held = ""
        running = chunk["finish_reason"] is None
        for_stop = first_stop(text, stops)
        if for_stop is not None:
            self.done = True
            return self._screened(text[:for_stop], "stop", running, stopped_early=running)
        if not running:
            self.done = True
            return self._screened(text, chunk["finish_reason"], running)
        keep = held_tail(text, stops)
        if keep:
            self.held = text[-keep:]
            text = text[:-keep]
        return self._screened(text, None, running)

    def _screened(self, text: str, finish_reason: str | None, running: bool,
                  stopped_early: bool = False) -> Emitted:
        """What is released of ``text``, through the output's safety check
        (workers/policy_checks.py) when the request's policy has one: the text
        before a match, and the end with ``content_filter``."""
        if self.scanner is not None:
            text, match = self.scanner.feed(text) if finish_reason is None \
                else self.scanner.finish(text)
            if match is not None:
                self.done = True
                self.filtered = match
                finish_reason, stopped_early = "content_filter", running
        return Emitted(text=text, finish_reason=finish_reason, stopped_early=stopped_early,
                       logprobs=self._release(text))

    def _release(self, text: str) -> list[TokenLogprob]:
        """The logprobs of the tokens that begin within the text released so
        far (with ``text``): a token's place is counted in bytes, as the
        engine's tokens hold them. At the end of the answer the rest (the
        stop sequence's tokens) is left out. Nothing to do (no encoding of the
        text) for an answer that did not ask for logprobs."""
        if not (self.header and self.header.get("logprobs")):
            return []
        self.released_bytes += len(text.encode())
        out: list[TokenLogprob] = []
        while self.pending and self.token_bytes < self.released_bytes:
            entry = self.pending.pop(0)
            self.token_bytes += len(entry["bytes"])
            out.append(entry)
        if self.done:
            self.pending.clear()
        return out


