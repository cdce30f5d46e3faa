"""Postprocess: turn each request's token chunks into the replies its client sees.

State is per request id (:class:`RequestStream`), in memory, rebuilt by replay:
the committed offset of a ``conveyor.tokens`` partition never passes the
first chunk of a request still open there. Replies carry an index and the
gateway drops repeats. Each request that ends also yields one
:class:`UsageRecord` on ``conveyor.usage``, keyed by tenant; the ledger counts
a replayed one once.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from aiokafka import TopicPartition

from conveyor.policy.rules import PolicyBook
from conveyor.policy.safety import StreamScanner
from conveyor.settings import Settings
from schemas.openai.chunks import delta_chunk, full_response, tool_call_chunk, usage_chunk
from schemas.openai.embeddings import embedding_response
from schemas.openai.logprobs import chat_logprobs, completion_logprobs
from schemas.records import (
    ChunkHeader,
    Control,
    ErrorInfo,
    Reply,
    TokenChunk,
    TokenLogprob,
    Usage,
)
from schemas.tool_calls import ToolCallReader
from topics.catalog import CONTROL, REPLIES, TOKENS
from topics.envelope import now_ms, stamp
from topics.policies import PolicyFollower
from workers.layer import Layer
from workers.outputs import Output, Sender, result_output, usage_output
from workers.policy_checks import policy_audit
from workers.postprocess.stream import Emitted, RequestStream

__all__ = ["PostprocessLayer"]

_FINISHED_MEMORY = 50_000
_EXPIRE_GRACE_MS = 60_000


class PostprocessLayer(Layer):
    name = "postprocess"
    source = TOKENS

    def __init__(self, settings: Settings, policies: PolicyBook | None = None) -> None:
        """``policies``: a book kept current by the caller; without one the layer
        follows ``conveyor.policies`` itself while it runs."""
        self.settings = settings
        self._follower = PolicyFollower(settings, policies)
        self.policies = self._follower.book
        self._replies = REPLIES.at(settings.kafka)
        self._control = CONTROL.at(settings.kafka)
        self.streams: dict[str, RequestStream] = {}
        # request id -> (topic partition, offset of its first chunk there)
        self._first: dict[str, tuple[TopicPartition, int]] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()

    async def start(self, sender: Sender) -> None:
        await self._follower.start()

    async def stop(self) -> None:
        await self._follower.stop()

    async def handle(self, event: TokenChunk, record: Any) -> list[Output]:
        rid = event["envelope"]["request_id"]
        if rid in self._finished:
            return []
        stream = self.streams.get(rid)
        if stream is None:
            envelope = stamp(event["envelope"], self.name)
            terms = self.policies.effective(envelope["tenant"], envelope["key_id"]).output_terms
            stream = RequestStream(envelope=envelope,
                                   scanner=None if terms.empty else StreamScanner(terms))
            self.streams[rid] = stream
            if record is not None:
                tp = TopicPartition(record.topic, record.partition)
                self._first[rid] = (tp, record.offset)
        outputs: list[Output] = []
        if stream.first_token_ms is None and (event["tokens"] > 0 or event["text"]):
            stream.first_token_ms = now_ms()
        for emitted in stream.take(event):
            outputs.extend(self._replies_for(stream, emitted))
        if stream.done:
            self._finish(rid)
            if stream.filtered is not None:
                envelope = stream.envelope
                policy = self.policies.effective(envelope["tenant"], envelope["key_id"])
                outputs.append(policy_audit(self.settings, envelope, "policy.output_blocked",
                                            stream.filtered, policy, self.name))
        return outputs

    def _replies_for(self, stream: RequestStream, e: Emitted) -> list[Output]:
        """At most one reply per applied chunk: every OpenAI chunk object it
        releases (role, content, finish, usage) travels in that one event."""
        rid = stream.envelope["request_id"]
        if stream.envelope.get("job_id"):
            return self._job_outputs(stream, e)
        if e.error is not None:
            return [self._reply(stream, "error", error=e.error),
                    self._usage_output(stream, "error", e.error)]
        header = stream.header or _NO_HEADER
        if header["kind"] == "embedding":
            return self._embedding_outputs(stream, header, e)
        chunks: list[str] = []
        if stream.reply_index == 0 and header["kind"] == "chat":
            chunks.append(delta_chunk(header, rid, "", role=True))
        called = False
        logprobs = _logprobs_object(stream, header, e)
        if header.get("tool_calls") and header["kind"] == "chat":
            called = self._tool_chunks(stream, header, e, chunks)
            if logprobs is not None:  # the tokens of the calls, beside them
                chunks.append(delta_chunk(header, rid, "", logprobs=logprobs))
        elif e.text:
            chunks.append(delta_chunk(header, rid, e.text, logprobs=logprobs))
        if e.finish_reason is None:
            # a reply for text the chunks hold back too (a tool call's head):
            # the gateway folds an unstreamed answer from the replies' text
            return [self._reply(stream, "delta", text=e.text, chunk="\n".join(chunks),
                                logprobs=e.logprobs)] if chunks or e.text else []
        # OpenAI knows "stop", "length" and "content_filter"; a cancelled
        # generation reads as stopped
        reason = e.finish_reason if e.finish_reason in ("stop", "length", "content_filter") \
            else "stop"
        if called and reason == "stop":
            reason = "tool_calls"
        usage = usage_of(header, stream)
        chunks.append(delta_chunk(header, rid, "", reason))
        if header["include_usage"]:
            chunks.append(usage_chunk(header, rid, usage))
        return [self._reply(stream, "final", text=e.text, chunk="\n".join(chunks),
                            finish_reason=reason, usage=usage, logprobs=e.logprobs),
                *self._completed(stream, e)]

    def _embedding_outputs(self, stream: RequestStream, header: ChunkHeader,
                           e: Emitted) -> list[Output]:
        """An embedding request's answer, built once here: OpenAI's list of
        vectors as the final reply's one object (nothing streams)."""
        if e.finish_reason is None:
            return []
        usage = usage_of(header, stream)
        if e.finish_reason == "cancelled":
            return [self._reply(stream, "final", finish_reason="stop", usage=usage),
                    self._usage_output(stream, "completed")]
        body = embedding_response(header["model"], stream.embeddings,
                                  header.get("encoding_format") or "float", usage)
        return [self._reply(stream, "final", chunk=body, finish_reason="stop", usage=usage),
                self._usage_output(stream, "completed")]

    def _completed(self, stream: RequestStream, e: Emitted) -> list[Output]:
        """The usage record of an answer, and the cancel that stops its worker
        when the answer ended early (a stop sequence, the content filter)."""
        out = [self._usage_output(stream, "completed")]
        if e.stopped_early:
            rid = stream.envelope["request_id"]
            why = "content filter" if e.finish_reason == "content_filter" else "stop sequence"
            cancel = Control(request_id=rid, action="cancel", reason=why, ts_ms=now_ms())
            out.append(Output(self._control, "Control", cancel, key=rid))
        return out

    @staticmethod
    def _tool_chunks(stream: RequestStream, header: ChunkHeader, e: Emitted,
                     chunks: list[str]) -> bool:
        """The chunks of an answer read for tool calls: its content and its calls'
        deltas (schemas/tools.py); whether it has made a call so far."""
        rid = stream.envelope["request_id"]
        if stream.tools is None:
            stream.tools = ToolCallReader(rid)
        events = stream.tools.feed(e.text) if e.text else []
        if e.finish_reason is not None:
            events += stream.tools.finish()
        for event in events:
            if event.kind == "content":
                chunks.append(delta_chunk(header, rid, event.text))
            elif event.kind == "call":
                chunks.append(tool_call_chunk(header, rid, event.index, "", event.id,
                                              event.name))
            else:
                chunks.append(tool_call_chunk(header, rid, event.index, event.text))
        return stream.tools.calls > 0

    def _job_outputs(self, stream: RequestStream, e: Emitted) -> list[Output]:
        """A job's request: nothing until it ends, then one result with the whole
        answer (the OpenAI body a batch output line carries). A generation
        stopped by a cancel is a 499 result: the job's collector leaves it out."""
        envelope = stream.envelope
        if e.error is not None:
            return [result_output(self.settings, envelope, status_code=e.error["status"],
                                  error=e.error), self._usage_output(stream, "error", e.error)]
        if e.text:
            stream.collected.append(e.text)
        stream.collected_logprobs.extend(e.logprobs)
        if e.finish_reason is None:
            return []
        header = stream.header or _NO_HEADER
        usage = usage_of(header, stream)
        text = "".join(stream.collected)
        if header["kind"] == "embedding" and e.finish_reason != "cancelled":
            body_text = embedding_response(header["model"], stream.embeddings,
                                           header.get("encoding_format") or "float", usage)
            return [result_output(self.settings, envelope, status_code=200, body=body_text,
                                  text="", finish_reason="stop", usage=usage),
                    self._usage_output(stream, "completed")]
        if e.finish_reason == "cancelled":
            cancelled = ErrorInfo(status=499, type="cancelled", code="cancelled", param=None,
                                  message="The request was cancelled.")
            result = result_output(self.settings, envelope, status_code=499, error=cancelled,
                                   text=text, finish_reason="cancelled", usage=usage)
        else:
            body = full_response(header["kind"], header["model"], header["created"],
                                 envelope["request_id"], text, e.finish_reason, usage,
                                 tool_calls=bool(header.get("tool_calls")),
                                 logprobs=stream.collected_logprobs if header.get("logprobs")
                                 else None)
            result = result_output(self.settings, envelope, status_code=200,
                                   body=json.dumps(body, ensure_ascii=False), text=text,
                                   finish_reason=e.finish_reason, usage=usage)
        return [result, *self._completed(stream, e)]

    def _reply(self, stream: RequestStream, kind: str, *, text: str = "", chunk: str = "",
               finish_reason: str | None = None, usage: Usage | None = None,
               error: Any = None, logprobs: list[TokenLogprob] | None = None) -> Output:
        # a reply between the first and the last carries no stamps
        envelope = stream.envelope if stream.reply_index == 0 or kind != "delta" \
            else stream.unstamped
        reply = Reply(envelope=envelope, index=stream.reply_index, kind=kind,  # type: ignore[typeddict-item]
                      text=text, chunk=chunk, finish_reason=finish_reason, usage=usage,
                      error=error, logprobs=list(logprobs or ()), cached=stream.from_cache)
        stream.reply_index += 1
        return Output(self._replies, "Reply", reply, key=stream.envelope["request_id"],
                      partition=stream.envelope["reply_partition"])

    def _usage_output(self, stream: RequestStream, status: str,
                      error: ErrorInfo | None = None) -> Output:
        """What the request cost (:func:`workers.outputs.usage_output`). An error
        counts the tokens generated before it (none before the first token)."""
        header = stream.header
        return usage_output(self.settings, stream.envelope, status=status,
                            model=header["model"] if header else "",
                            kind=header["kind"] if header else "chat",
                            prompt_tokens=header["prompt_tokens"] if header else 0,
                            completion_tokens=stream.completion_tokens,
                            first_token_ms=stream.first_token_ms,
                            error_code=error["code"] if error else None,
                            asked_model=header.get("asked", "") if header else "")

    def _finish(self, rid: str) -> None:
        self.streams.pop(rid, None)
        self._first.pop(rid, None)
        self._finished[rid] = None
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def committable(self, tp: TopicPartition, next_offset: int) -> int:
        """Never commit past the first chunk of a request still open on ``tp``."""
        self._expire()
        firsts = [off for (p, off) in self._first.values() if p == tp]
        return min([next_offset, *firsts])

    def revoked(self, partitions: list[TopicPartition]) -> None:
        """Requests on those partitions are rebuilt by their new owner from the log."""
        gone = set(partitions)
        for rid, (tp, _) in list(self._first.items()):
            if tp in gone:
                self.streams.pop(rid, None)
                self._first.pop(rid, None)

    def _expire(self) -> None:
        """Forget requests whose deadline is long gone (their worker died for good)."""
        now = now_ms()
        for rid, stream in list(self.streams.items()):
            deadline = stream.envelope["deadline_ms"]
            if deadline and now > deadline + _EXPIRE_GRACE_MS:
                self._finish(rid)


# the header of a stream whose first chunk never came (an error before it)
_NO_HEADER = ChunkHeader(kind="chat", model="", created=0, stop=[], stream=True,
                         include_usage=False, prompt_tokens=0)


def usage_of(header: ChunkHeader, stream: RequestStream) -> Usage:
    """The answer's usage; the cached count never exceeds the prompt's (an engine
    counts a continued answer's prompt with the text already sent)."""
    return Usage(prompt_tokens=header["prompt_tokens"],
                 completion_tokens=stream.completion_tokens,
                 cached_tokens=min(stream.cached_tokens, header["prompt_tokens"]))


def _logprobs_object(stream: RequestStream, header: ChunkHeader,
                     e: Emitted) -> dict[str, Any] | None:
    """OpenAI's logprobs of the tokens an applied chunk releases (None: none)."""
    if not e.logprobs:
        return None
    if header["kind"] == "chat":
        return chat_logprobs(e.logprobs)
    out = completion_logprobs(e.logprobs, stream.logprob_chars)
    stream.logprob_chars += sum(len(entry["token"]) for entry in e.logprobs)
    return out
