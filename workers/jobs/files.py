"""A batch's input file (read from the file store, conveyor/files) checked
line by line and turned into Generations (:func:`parse_lines`). OpenAI's
format: one ``{"custom_id", "method": "POST", "url", "body"}`` a line, each
checked as a request sent alone (no streaming, unique custom ids) before any
runs; a file with any bad line fails whole, naming the first
:data:`MAX_ERRORS` bad lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from conveyor.errors import RequestError
from schemas.openai.embeddings import EmbeddingBody, embedding_generation
from schemas.openai.generations import chat_generation, completion_generation
from schemas.openai.requests import ChatCompletionRequest, CompletionRequest, invalid_request
from schemas.records import Generation

__all__ = ["Line", "MAX_ERRORS", "parse_lines"]


MAX_ERRORS = 100


@dataclass(frozen=True)
class Line:
    index: int  # 0-based position among the file's non-empty lines
    custom_id: str
    generation: Generation


def parse_lines(data: bytes, endpoint: str, max_lines: int
                ) -> tuple[list[Line], list[dict[str, Any]]]:
    """The lines of a batch file, or the errors that fail it (OpenAI's shape:
    ``{"code", "line" (1-based), "message", "param"}``)."""
    errors: list[dict[str, Any]] = []
    lines: list[Line] = []
    seen: set[str] = set()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return [], [_error("invalid_file", None, "The file is not UTF-8 text.")]
    numbered = [(n, raw) for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not numbered:
        return [], [_error("empty_file", None, "The file has no requests.")]
    if len(numbered) > max_lines:
        return [], [_error("too_many_requests", None,
                           f"The file has {len(numbered)} requests; a batch takes at most "
                           f"{max_lines}.")]
    for number, raw in numbered:
        try:
            line = _line(len(lines), raw, endpoint, seen)
        except _BadLine as bad:
            errors.append(_error(bad.code, number, bad.message, bad.param))
            if len(errors) >= MAX_ERRORS:
                break
            continue
        lines.append(line)
    return (lines, []) if not errors else ([], errors)


class _BadLine(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _line(index: int, raw: str, endpoint: str, seen: set[str]) -> Line:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError:
        raise _BadLine("invalid_json_line", "This line is not valid JSON.") from None
    if not isinstance(item, dict):
        raise _BadLine("invalid_json_line", "This line is not a JSON object.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _BadLine("missing_required_parameter", "custom_id must be a non-empty string.",
                       "custom_id")
    if custom_id in seen:
        raise _BadLine("duplicate_custom_id", f"The custom_id {custom_id!r} is used twice.",
                       "custom_id")
    seen.add(custom_id)
    if item.get("method") != "POST":
        raise _BadLine("invalid_method", "method must be POST.", "method")
    if item.get("url") != endpoint:
        raise _BadLine("mismatched_url", f"url must be the batch's endpoint, {endpoint}.",
                       "url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise _BadLine("invalid_request", "body must be a JSON object.", "body")
    if body.get("stream"):
        raise _BadLine("invalid_request", "A batch request cannot stream.", "body.stream")
    try:
        if endpoint == "/v1/chat/completions":
            generation = chat_generation(ChatCompletionRequest.model_validate(body))
        elif endpoint == "/v1/embeddings":
            generation = embedding_generation(EmbeddingBody.model_validate(body))
        else:
            generation = completion_generation(CompletionRequest.model_validate(body))
    except (ValidationError, RequestError) as exc:
        fault = invalid_request(exc.errors()) if isinstance(exc, ValidationError) else exc
        raise _BadLine("invalid_request", fault.message,
                       f"body.{fault.param}" if fault.param else "body") from None
    return Line(index, custom_id, generation)


def _error(code: str, line: int | None, message: str,
           param: str | None = None) -> dict[str, Any]:
    return {"code": code, "line": line, "message": message, "param": param}
