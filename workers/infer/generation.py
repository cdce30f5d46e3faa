"""One task run: engine pieces -> TokenChunk events, through the worker's
records on conveyor.tokens (workers/infer/token_records.py).

The first chunk goes out at once (time to first token matters most); after
that a streamed answer's pieces are held until the worker's next tick, which
takes them as one chunk into the record of every stream on that partition. A
request that is not streamed is coalesced for ``coalesce_unstreamed_ms``: its
chunks are only checkpoints for a retry to continue from. Every chunk names
its run (``run_id``, and ``run_start``, the seq the run began at), so that
readers of the log apply one run's chunks at each seq (:mod:`workers.chunk_order`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
import uuid
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry.util.types import AttributeValue

from conveyor.errors import (
    DeadlineExceeded,
    EngineError,
    InvalidOutput,
    InvalidRequest,
    RequestError,
)
from conveyor.files.images import ImageStore
from conveyor.files.local import LocalFileStore
from conveyor.settings import Settings
from schemas.answer_format import violation
from schemas.images import first_image
from schemas.records import (
    ChunkHeader,
    Embedding,
    ErrorInfo,
    Generation,
    ResponseFormat,
    Task,
    TokenChunk,
    TokenLogprob,
)
from schemas.structured import check_format
from schemas.tools import check_tools, reads_tool_calls, tool_format
from topics.catalog import ROUTED
from topics.envelope import now_ms, stamp, unstamped
from topics.tracing import genai_request_attributes
from workers.infer.engines.base import EmbeddingRequest, Engine, GenerationRequest
from workers.infer.heartbeat import Speed
from workers.infer.progress import ProgressTracker
from workers.infer.token_records import TokenRecords
from workers.outputs import Output, error_info
from workers.prefix import tenant_salt
from workers.prompt_cache import Cached, PromptCache, chunk_header

__all__ = ["TaskRun", "request_from_task"]

# how often a task whose lease another worker holds asks again (a handed-off
# task's new owner waits only this long after the old one lets go)
_BUSY_POLL_S = 0.1


def request_from_task(task: Task, continuation: str, done_tokens: int,
                      upstream_model: str | None, shared_prefixes: bool = False
                      ) -> GenerationRequest:
    """What the engine is asked for; its prompt reuses only the prefixes its
    tenant's prompts left in the engine's caches, unless ``shared_prefixes``
    (the setting ``prefix_cache_shared``)."""
    gen = task["generation"]
    sampling = gen["sampling"]
    prompt_text = task["prompt"]["text"]
    if task["route"].get("fallback_from"):
        prompt_text = None  # rendered for the model asked for: the engine renders its own
    if gen["kind"] == "completion" and prompt_text is None:
        prompt_text = gen["prompt"] or ""
    kind = gen["kind"]
    assert kind != "embedding", "an embedding request is embedded, not generated"
    return GenerationRequest(
        request_id=task["envelope"]["request_id"],
        kind=kind,
        model=task["route"]["model"],
        max_tokens=max(1, task["prompt"]["max_tokens"] - done_tokens),
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        seed=sampling["seed"],
        stop=tuple(sampling["stop"]),
        presence_penalty=sampling["presence_penalty"],
        frequency_penalty=sampling["frequency_penalty"],
        logit_bias=tuple((int(t), b) for t, b in (sampling.get("logit_bias") or {}).items()),
        logprobs=bool(sampling.get("logprobs")),
        top_logprobs=sampling.get("top_logprobs") or 0,
        prompt_text=prompt_text,
        messages=tuple(gen["messages"]),
        continuation=continuation,
        upstream_model=upstream_model,
        response_format=gen.get("response_format") or _tool_format(gen),
        cache_salt=tenant_salt(task["envelope"]["tenant"], shared_prefixes),
    )


def _tool_format(gen: Generation) -> ResponseFormat | None:
    """The format a request's tools hold the answer to, when it is read for calls."""
    tools = gen.get("tools")
    return tool_format(tools) if tools and reads_tool_calls(gen) else None


@dataclass
class TaskRun:
    settings: Settings
    engine: Engine
    progress: ProgressTracker
    worker_id: str
    task: Task
    # the worker's records on conveyor.tokens, which every chunk goes out in
    records: TokenRecords
    upstream_model: str | None = None
    cancelled: bool = False
    # the task's partition went to another worker, which continues it from the
    # log: the run stops after the next piece without finishing the answer
    handed_off: bool = False
    # this run holds the task's lease (renewed by the worker while it runs)
    leased: bool = False
    # when the task was written to its topic (its record's timestamp)
    written_ms: int = 0
    # the engine failed: its traceback, for the dead-letter topic
    engine_failure: str | None = None
    # how the answer ended (its last chunk's finish reason), once it has
    finish_reason: str | None = None
    # of the prompt's tokens, how many the engine's prefix cache held (engines that say)
    cached_tokens: int | None = None
    # the worker's measured speed, which each whole generation adds to
    speed: Speed | None = None
    # the engine failed before the first token: the task went to schedule again
    retried: bool = False

    @property
    def request_id(self) -> str:
        return self.task["envelope"]["request_id"]

    def span_attributes(self) -> dict[str, AttributeValue]:
        """The infer span's attributes under the GenAI conventions: the request's,
        its usage (the whole answer's, earlier runs included) and how it ended."""
        attributes: dict[str, AttributeValue] = {
            **genai_request_attributes(self.task["generation"]),
            "gen_ai.usage.input_tokens": self.task["prompt"]["tokens"],
            "gen_ai.usage.output_tokens": self.tokens,
        }
        if self.finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = [self.finish_reason]
        return attributes

    async def run(self) -> None:
        envelope = stamp(self.task["envelope"], "infer")
        self.run_id = uuid.uuid4().hex[:12]
        self.seq, self.run_start, self.text, self.tokens = 0, 0, "", 0
        self._acks: list[asyncio.Future[Any]] = []
        # pieces not yet in a chunk, and the partition of the request's chunks
        self._held: list[str] = []
        self._held_logprobs: list[TokenLogprob] = []
        self._held_tokens = 0
        self._partition: int | None = None
        entered_ms = envelope["stamps"].get("gateway", now_ms() * 1000) // 1000
        claim, done = await self.progress.claim(self.request_id, self.worker_id,
                                                self.written_ms, entered_ms)
        while claim == "busy":  # a duplicate: wait for the running one to end or lapse
            if self.cancelled or self._past_deadline():
                return
            await asyncio.sleep(_BUSY_POLL_S)
            claim, done = await self.progress.claim(self.request_id, self.worker_id,
                                                    self.written_ms, entered_ms)
        self.leased = True
        if claim == "done":
            await self.progress.finish(self.request_id, self.worker_id)
            return  # it ended before; only its offset was still to commit
        if done.next_seq:
            # an earlier run sent part of the answer: continue after it
            envelope["attempt"] += 1
            self.seq, self.text, self.tokens = done.next_seq, done.text, done.tokens
        self.run_start = self.seq
        if self.cancelled:
            if self.seq:  # close the answer an earlier run left open
                self._emit(self._chunk("", 0, "cancelled"))
        elif self._past_deadline():
            await self._fail(DeadlineExceeded("The request's deadline passed."))
        else:
            try:
                if self.task["generation"]["kind"] == "embedding":
                    await self._embed()
                else:
                    request = request_from_task(self.task, self.text, self.tokens,
                                                self.upstream_model,
                                                self.settings.prefix.cache_shared)
                    self._check(request)
                    await self._stream(await self._with_images(request))
            except EngineError as exc:
                self.engine_failure = traceback.format_exc()
                if not await self._retry_elsewhere(exc):
                    await self._fail(exc)
            except RequestError as exc:
                await self._fail(exc)
        # the task may be committed once every chunk of it is in the log
        await asyncio.gather(*self._acks)
        await self._keep_in_cache()
        if self.handed_off or self.retried:
            await self.progress.release(self.request_id)
        else:
            await self.progress.finish(self.request_id, self.worker_id)

    def _check(self, request: GenerationRequest) -> None:
        """Refuse what the engine cannot do; check the tools and the format again
        (the API checked them; an event may be forged)."""
        tools, fmt, engine = self.task["generation"].get("tools"), request.response_format, \
            self.engine
        reads_tools = bool(tools) and reads_tool_calls(self.task["generation"])
        if tools and reads_tools:
            check_tools(tools)
        elif fmt:
            check_format(fmt, param="response_format")
        for what, param, refused in (
                ("tools are", "tools", reads_tools and not engine.decodes_tools),
                ("logprobs is", "logprobs", request.logprobs and not engine.reports_logprobs),
                ("logit_bias is", "logit_bias",
                 bool(request.logit_bias) and not engine.biases_logits),
                (f"response_format {fmt['type']!r} is" if fmt else "", "response_format",
                 bool(fmt) and not engine.constrains_output)):
            if refused:
                raise InvalidRequest(f"{what} not supported by the {engine.name} engine "
                                     f"serving {request.model}", param=param)
        image = first_image(request.messages)
        if image is not None and not engine.sees_images:
            raise InvalidRequest(f"'{image.get('part')}' is an image part: the {engine.name} "
                                 f"engine serving {request.model} does not read images",
                                 param=image.get("part") or None)

    async def _with_images(self, request: GenerationRequest) -> GenerationRequest:
        """The request with the bytes of its messages' images, read from the file
        store (the tenant's own files), by sha256."""
        refs = {ref["sha256"]: ref for m in request.messages for ref in m.get("images") or ()}
        if not refs:
            return request
        store = ImageStore(LocalFileStore(self.settings.jobs))
        tenant = self.task["envelope"]["tenant"]
        images = {digest: await store.read(tenant, ref["file_id"], digest, ref.get("part", ""))
                  for digest, ref in refs.items()}
        return replace(request, images=images)

    async def _embed(self) -> None:
        """An embedding request: every input's vector in the run's one chunk,
        each as float32 bytes in its own field (never text)."""
        ask = self.task["generation"].get("embedding")
        if not self.engine.embeds:
            raise InvalidRequest(f"The model `{self.task['generation']['model']}` does not "
                                 f"serve embeddings (the {self.engine.name} engine).",
                                 param="model")
        if not ask:
            raise InvalidRequest("An embedding request without inputs.", param="input")
        request = EmbeddingRequest(
            request_id=self.request_id, model=self.task["route"]["model"],
            inputs=tuple(i if isinstance(i, str) else tuple(i) for i in ask["inputs"]),
            dimensions=ask.get("dimensions"), upstream_model=self.upstream_model)
        vectors = await self.engine.embed(request)
        if self.cancelled:
            self._emit(self._chunk("", 0, "cancelled"))
            return
        chunk = self._chunk("", 0, "stop")
        chunk["embeddings"] = [Embedding(index=i, vector=row.astype("<f4").tobytes())
                               for i, row in enumerate(vectors)]
        self._emit(chunk)

    async def _keep_in_cache(self) -> None:
        """A whole answer whose request named a cache key goes into the prompt
        cache (workers/prompt_cache.py), with the model that gave it."""
        key = self.task["prompt"].get("cache_key")
        if not key or self.finish_reason not in ("stop", "length") or self.handed_off:
            return
        await PromptCache(self.settings, self.progress.redis).put(
            key, Cached(self.text, self.tokens, self.finish_reason, self.answered_by),
            self.task["prompt"].get("cache_ttl_s") or 0)

    async def _retry_elsewhere(self, exc: EngineError) -> bool:
        """An engine failure before any token of the answer was written: send the
        task to schedule again, naming this worker as failed (schedule counts it
        against the worker's breaker and places the task on another worker, or a
        fallback model's), at most ``engine_retries`` times. Whether it did."""
        route = self.task["route"]
        failed = list(route.get("failed_workers") or [])
        if self.seq != 0 or len(failed) >= self.settings.schedule.engine_retries \
                or self._past_deadline():
            return False
        again = Task(envelope=stamp(self.task["envelope"], "infer"),
                     generation=self.task["generation"], prompt=self.task["prompt"],
                     route={**route, "failed_workers": [*failed, self.worker_id],
                            "failure": error_info(exc), "worker_id": "", "partition": -1})
        self._acks.append(await self.records.sender.send_nowait(
            Output(ROUTED.at(self.settings.kafka), "Task", again, key=self.request_id)))
        self.retried = True
        self.finish_reason = "retried"
        return True

    def _past_deadline(self) -> bool:
        deadline = self.task["envelope"]["deadline_ms"]
        return bool(deadline) and now_ms() >= deadline

    async def _stream(self, request: GenerationRequest) -> None:
        streamed = self.task["generation"]["stream"]
        unstreamed_s = self.settings.infer.coalesce_unstreamed_ms / 1000
        last_flush = 0.0
        finish: str | None = None
        asked, first, produced = time.monotonic(), 0.0, 0
        # the whole answer, kept only for a structured one's check
        answer = [request.continuation] if request.response_format else None
        pieces = self.engine.generate(request)
        try:
            async for piece in pieces:
                self._held.append(piece.text)
                self._held_logprobs.extend(piece.logprobs)
                if answer is not None:
                    answer.append(piece.text)
                self._held_tokens += piece.tokens
                produced += piece.tokens
                if not first and piece.tokens:
                    first = time.monotonic()
                if piece.finish_reason is not None:
                    finish = piece.finish_reason
                    self.cached_tokens = piece.cached_tokens
                    break
                if self.cancelled:
                    finish = "cancelled"
                    break
                if self.handed_off:
                    break
                now = time.monotonic()
                if self.seq == self.run_start:  # the first chunk: at once
                    self._emit(self._held_chunk(None))
                    last_flush = now
                elif streamed:  # the worker's next tick takes what is held
                    self.records.wants(self)
                elif now - last_flush >= unstreamed_s:  # a checkpoint of an unstreamed answer
                    self._emit(self._held_chunk(None), at_once=False)
                    last_flush = now
        finally:
            with contextlib.suppress(Exception):
                await pieces.aclose()
        if finish is None and self.handed_off:
            if self._held_tokens:
                self._emit(self._held_chunk(None))
            return
        if finish is None:
            finish = "cancelled" if self.cancelled else "stop"
        if self.speed is not None and first and finish != "cancelled":
            uncached = self.task["prompt"]["tokens"] - (self.cached_tokens or 0)
            self.speed.observe(uncached if not self.run_start else 0, first - asked,
                               produced - 1, time.monotonic() - first)
        fmt = request.response_format
        wrong = violation(fmt, "".join(answer)) if fmt and answer is not None \
            and finish == "stop" else None
        if wrong is not None:  # what the grammar could not hold the engine to
            self._emit(self._held_chunk(None))
            tool_calls = fmt is not None and fmt["type"] == "tool_calls"
            await self._fail(InvalidOutput(
                f"The model's tool calls are not valid: {wrong}." if tool_calls else
                f"The model's answer does not satisfy response_format: {wrong}.",
                param="tools" if tool_calls else "response_format",
                code="invalid_tool_call" if tool_calls else None))
            return
        self._emit(self._held_chunk(finish))

    @property
    def answered_by(self) -> str:
        """The model the answer names: a fallback's, a canary's or an alias routed
        by meaning's answer names the model that gave it."""
        route = self.task["route"]
        return route["model"] if route.get("fallback_from") or route.get("deployment_of") \
            or route.get("meaning") else self.task["generation"]["model"]

    def _header(self) -> ChunkHeader | None:
        if self.seq != 0:
            return None
        return chunk_header(self.task["generation"], self.answered_by, self.task["prompt"])

    def _chunk(self, text: str, tokens: int, finish: str | None, error: ErrorInfo | None = None,
               logprobs: list[TokenLogprob] | None = None) -> TokenChunk:
        """The next chunk of the answer (its seq taken)."""
        # a chunk between the run's first and its last carries no stamps
        middle = self.seq != self.run_start and finish is None and error is None
        envelope = unstamped(self.task["envelope"]) if middle else self.task["envelope"]
        chunk = TokenChunk(envelope=envelope, seq=self.seq, text=text,
                           tokens=tokens, finish_reason=finish, worker_id=self.worker_id,
                           header=self._header(), error=error, run_id=self.run_id,
                           run_start=self.run_start,
                           cached_tokens=self.cached_tokens if finish is not None else None,
                           logprobs=list(logprobs or ()))
        self.seq += 1
        self.tokens += tokens
        if self.task["prompt"].get("cache_key"):
            self.text += text
        if finish is not None:
            self.finish_reason = finish
        return chunk

    def _emit(self, chunk: TokenChunk, at_once: bool = True) -> None:
        """Hand one chunk to the worker's records (workers/infer/token_records.py)
        without waiting for it to be in the log: run() waits for all of them."""
        if self._partition is None:
            self._partition = self.records.partition(self.request_id)
        self._acks.append(self.records.add(chunk, self._partition, at_once))

    def _holds(self) -> bool:
        return bool(self._held_tokens) or any(self._held)

    def _held_chunk(self, finish: str | None) -> TokenChunk:
        """The pieces held (none, for a last chunk that only ends) as the next chunk."""
        text, tokens, logprobs = "".join(self._held), self._held_tokens, self._held_logprobs
        self._held, self._held_tokens, self._held_logprobs = [], 0, []
        return self._chunk(text, tokens, finish, logprobs=logprobs)

    def take(self) -> tuple[TokenChunk, int, asyncio.Future[None]] | None:
        """The pieces held, as one chunk, for the worker's tick (None: none held)."""
        if not self._holds():
            return None
        chunk = self._held_chunk(None)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acks.append(done)
        assert self._partition is not None  # the first chunk went out before any tick
        return chunk, self._partition, done

    async def _fail(self, exc: RequestError) -> None:
        if self._holds():  # what came before the failure, in order
            self._emit(self._held_chunk(None))
        self._emit(self._chunk("", 0, None, error=error_info(exc)))

