"""The jobs layer's requests: a batch's lines and a background response become
requests with the personal data their tenant's policy redacts replaced."""

from __future__ import annotations

import json
from typing import Any

from conveyor.policy.rules import PolicyBook
from conveyor.settings import load_settings
from schemas.records import Generation, JobCommand, Request
from tests.support.factories import generation
from workers.jobs.commands import JobsLayer

ANN = "ann@example.com"
PHONE = "+1 415 555 0134"


class Files:
    """One batch input file, in memory (the layer reads it, never writes)."""

    def __init__(self, content: bytes) -> None:
        self.content = content

    async def read(self, tenant: str, file_id: str) -> bytes:
        return self.content

    async def create(self, tenant: str, purpose: Any, filename: str, content: bytes,
                     file_id: str | None = None) -> Any:
        raise AssertionError("the jobs layer writes no file")


def _layer(content: bytes = b"") -> JobsLayer:
    book = PolicyBook()
    book.set("tenant:acme", '[pii]\nredact = ["email", "phone"]\n')
    return JobsLayer(load_settings(), Files(content), policies=book)


def _command(kind: str, generation: Generation | None = None) -> JobCommand:
    return JobCommand(job_id=f"{kind}_1", kind=kind, action="create",  # type: ignore[typeddict-item]
                      tenant="acme", key_id="", ts_ms=0, input_file_id="file-1",
                      endpoint="/v1/chat/completions", completion_window="24h", metadata={},
                      generation=generation, models=[], body="{}")


def _requests(outputs: list[Any]) -> list[Request]:
    return [o.record for o in outputs if o.event_type == "Request"]


async def test_a_batch_s_lines_are_redacted_before_they_become_requests() -> None:
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2", "messages": [
                  {"role": "user", "content": f"line {i}: write to {ANN} or call {PHONE}"}]}}
             for i in range(3)]
    content = "\n".join(json.dumps(line) for line in lines).encode()
    requests = _requests(await _layer(content).handle(_command("batch"), None))
    assert [r["generation"]["messages"][0]["content"] for r in requests] == \
        [f"line {i}: write to <EMAIL_1> or call <PHONE_1>" for i in range(3)]


async def test_a_background_response_is_redacted_again_as_it_enters_the_log() -> None:
    said = generation([{"role": "user", "content": f"write to {ANN}", "name": None,
                        "tool_calls": None, "tool_call_id": None}])
    requests = _requests(await _layer().handle(_command("response", said), None))
    assert [r["generation"]["messages"][0]["content"] for r in requests] == \
        ["write to <EMAIL_1>"]
