"""Builders for the events tests feed to layers (plain dicts, as the codec makes them)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Literal

from fastavro import schemaless_writer
from fastavro.schema import fingerprint, to_parsing_canonical_form

from schemas.codec import MAGIC
from schemas.records import Generation, Message, Request, TokenChunk
from topics.envelope import new_envelope

__all__ = ["Record", "chunk", "encoded_with", "generation", "request"]


def encoded_with(writer_schema: Any, record: Any) -> bytes:
    """``record`` as Conveyor frames a value, written with an explicit schema
    (one the codec does not know: a newer or a foreign writer's)."""
    buf = io.BytesIO()
    buf.write(MAGIC + bytes.fromhex(fingerprint(to_parsing_canonical_form(writer_schema),
                                                "CRC-64-AVRO")))
    schemaless_writer(buf, writer_schema, record)
    return buf.getvalue()


def generation(
    messages: list[Message] | None = None,
    *,
    model: str = "smollm2",
    max_tokens: int | None = None,
    kind: Literal["chat", "completion"] = "chat",
    prompt: str | None = None,
    temperature: float = 1.0,
    created: int = 0,
    store: bool = False,
    metadata: dict[str, str] | None = None,
    api: str = "",
) -> Generation:
    return {
        "kind": kind,
        "model": model,
        "messages": messages if messages is not None else [],
        "prompt": prompt,
        "sampling": {
            "temperature": temperature,
            "top_p": 1.0,
            "max_tokens": max_tokens,
            "stop": [],
            "seed": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "logit_bias": {},
            "logprobs": False,
            "top_logprobs": 0,
        },
        "stream": False,
        "include_usage": False,
        "created": created,
        "store": store,
        "metadata": dict(metadata or {}),
        "api": api,
        "response_format": None,
        "tools": None,
        "previous_response_id": "",
        "history_messages": 0,
    }


def request(messages: list[Message] | None = None, *, request_id: str = "r1",
            **fields: object) -> Request:
    return {
        "envelope": new_envelope(request_id, reply_gateway="g", reply_partition=0),
        "generation": generation(messages, **fields),  # type: ignore[arg-type]
    }


@dataclass
class Record:
    """Where a layer's event was read from: what its handler looks at of a
    consumed record."""

    topic: str
    partition: int
    offset: int


def chunk(request_id: str, seq: int, text: str = "", *, tokens: int = 1,
          finish: str | None = None, run_id: str = "run-a") -> TokenChunk:
    """One chunk of ``request_id``'s answer, as a worker writes it."""
    return TokenChunk(envelope=new_envelope(request_id, reply_gateway="g", reply_partition=0),
                      seq=seq, text=text, tokens=tokens, finish_reason=finish, worker_id="w0",
                      header=None, error=None, run_id=run_id, run_start=0, cached_tokens=None,
                      logprobs=[])
