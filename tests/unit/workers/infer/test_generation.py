"""request_from_task: what the engine is asked for, first attempt and continuation."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from schemas.records import Message, Task, TokenChunk
from topics.envelope import new_envelope
from workers.infer.generation import request_from_task
from workers.prefix import tenant_salt


def task(kind: Literal["chat", "completion"] = "chat", *, max_tokens: int = 64,
         prompt_text: str | None = "<rendered>", prompt: str | None = None) -> Task:
    messages: list[Message] = (
        [{"role": "user", "content": "Hi", "name": None}] if kind == "chat" else []
    )
    return {
        "envelope": new_envelope("r1", reply_gateway="g", reply_partition=0),
        "generation": {
            "kind": kind,
            "model": "smollm2",
            "messages": messages,
            "prompt": prompt,
            "sampling": {"temperature": 0.5, "top_p": 0.9, "max_tokens": None,
                         "stop": ["\n\n", "END"], "seed": 7, "presence_penalty": 0.5,
                         "frequency_penalty": -1.0},
            "stream": True,
            "include_usage": False,
            "created": 1,
        },
        "prompt": {"text": prompt_text, "tokens": 12, "exact": True, "max_tokens": max_tokens,
                   "dropped_messages": 0, "fingerprint": "f", "prefix_blocks": []},
        "route": {"model": "smollm2-135m-instruct", "pool": "cpu", "worker_id": "w0",
                  "partition": 0},
    }


def test_a_first_attempt() -> None:
    r = request_from_task(task(), "", 0, None)
    assert r.request_id == "r1"
    assert r.kind == "chat"
    assert r.model == "smollm2-135m-instruct"  # the route's canonical name
    assert r.max_tokens == 64
    assert (r.temperature, r.top_p, r.seed) == (0.5, 0.9, 7)
    assert (r.presence_penalty, r.frequency_penalty) == (0.5, -1.0)  # dropped here once
    assert r.stop == ("\n\n", "END")
    assert r.prompt_text == "<rendered>"
    assert r.messages == ({"role": "user", "content": "Hi", "name": None},)
    assert r.continuation == ""
    assert r.upstream_model is None


def test_a_continuation_asks_only_for_the_tokens_left() -> None:
    r = request_from_task(task(max_tokens=64), "Hello, wor", 10, "upstream-name")
    assert r.continuation == "Hello, wor"
    assert r.max_tokens == 54
    assert r.upstream_model == "upstream-name"


def test_a_continuation_asks_for_at_least_one_token() -> None:
    assert request_from_task(task(max_tokens=8), "x" * 8, 8, None).max_tokens == 1
    assert request_from_task(task(max_tokens=8), "x" * 9, 9, None).max_tokens == 1


def test_a_completion_falls_back_to_its_raw_prompt() -> None:
    r = request_from_task(task("completion", prompt_text=None, prompt="Once upon"), "", 0, None)
    assert r.kind == "completion"
    assert r.prompt_text == "Once upon"
    assert r.messages == ()


def test_a_completion_without_any_prompt_gets_an_empty_one() -> None:
    r = request_from_task(task("completion", prompt_text=None, prompt=None), "", 0, None)
    assert r.prompt_text == ""


def test_a_rendered_prompt_wins_over_the_raw_one() -> None:
    r = request_from_task(task("completion", prompt_text="rendered", prompt="raw"), "", 0, None)
    assert r.prompt_text == "rendered"


def test_a_chat_without_a_rendered_prompt_keeps_its_messages() -> None:
    # An HTTP upstream renders the template itself: no prompt text, only messages.
    r = request_from_task(task("chat", prompt_text=None), "", 0, None)
    assert r.prompt_text is None
    assert len(r.messages) == 1


def test_a_structured_request_carries_its_format_to_the_engine() -> None:
    t = task()
    assert request_from_task(t, "", 0, None).response_format is None
    fmt = {"type": "json_object", "name": "", "schema": "", "strict": False}
    t["generation"]["response_format"] = fmt  # type: ignore[typeddict-item]
    assert request_from_task(t, '{"a": ', 3, None).response_format == fmt


def test_the_prompt_reuses_only_its_tenant_s_prefixes_unless_they_are_shared() -> None:
    acme, globex = task(), task()
    acme["envelope"]["tenant"], globex["envelope"]["tenant"] = "acme", "globex"
    salt = request_from_task(acme, "", 0, None).cache_salt
    assert salt == tenant_salt("acme") != request_from_task(globex, "", 0, None).cache_salt
    assert salt and "acme" not in salt
    assert request_from_task(acme, "Pa", 2, None).cache_salt == salt  # a retry too
    assert request_from_task(acme, "", 0, None, shared_prefixes=True).cache_salt == ""


class Captured:
    """What a worker's records hand its producer: the outputs, each taken at once."""

    def __init__(self) -> None:
        self.outs: list[Any] = []

    async def send_nowait(self, out: Any) -> asyncio.Future[None]:
        self.outs.append(out)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def _written(streams: int, token_delay_ms: float = 20.0, runs: int = 1
                   ) -> tuple[list[TokenChunk], list[int]]:
    """The chunks ``runs`` runs write for 12 scripted tokens ``token_delay_ms``
    apart while their worker runs ``streams`` streams (coalesce_ms 40), and the
    chunks each record held."""
    from conveyor.settings import load_settings
    from workers.infer.engines.scripted import ScriptedEngine
    from workers.infer.generation import TaskRun
    from workers.infer.token_records import TokenRecords

    settings = load_settings(coalesce_ms=40, pipeline_partitions=1)
    engine = ScriptedEngine("echo", token_delay_ms=token_delay_ms, capacity=runs)
    await engine.start()
    captured = Captured()
    records = TokenRecords(settings, captured, lambda: streams)  # type: ignore[arg-type]
    records.start()

    async def one(i: int) -> None:
        made = task(max_tokens=12)
        made["envelope"]["request_id"] = f"r{i}"
        made["generation"]["messages"] = [
            {"role": "user", "content": "1 2 3 4 5 6 7 8 9 10 11 12", "name": None}]
        run = TaskRun(settings, engine, None, "w0", made, records)  # type: ignore[arg-type]
        run.seq = run.run_start = 0
        run.run_id, run.text, run.tokens, run._acks = "run", "", 0, []
        run._held, run._held_logprobs, run._held_tokens, run._partition = [], [], 0, None
        await run._stream(request_from_task(made, "", 0, None))
        await asyncio.gather(*run._acks)

    await asyncio.gather(*(one(i) for i in range(runs)))
    await records.close()
    await engine.close()
    chunks = [c for out in captured.outs for c in out.record["chunks"]]
    return chunks, [len(out.record["chunks"]) for out in captured.outs]


async def _chunks_of(streams: int, token_delay_ms: float = 20.0, runs: int = 1
                     ) -> tuple[list[int], list[int]]:
    """The tokens of each chunk that carries some, and the chunks each record held."""
    chunks, held = await _written(streams, token_delay_ms, runs)
    return [c["tokens"] for c in chunks if c["tokens"]], held


async def test_a_stream_alone_gets_each_piece_at_once() -> None:
    alone, records = await _chunks_of(streams=1)
    assert alone == [1] * len(alone) and len(alone) >= 10
    assert records == [1] * len(alone)  # the last piece ends the answer


async def test_under_load_pieces_fill_a_window() -> None:
    alone, _ = await _chunks_of(streams=1)
    busy, _ = await _chunks_of(streams=64)  # a window of 39 ms: about two 20-ms tokens a chunk
    assert sum(busy) == sum(alone)
    assert len(busy) <= len(alone) * 2 // 3


async def test_the_streams_of_one_partition_share_their_records() -> None:
    """Eight runs at once, each 12 tokens: a tick writes one record holding the
    pieces of all eight; only a first or a last chunk goes out without waiting."""
    tokens, records = await _chunks_of(streams=8, runs=8)
    assert sum(tokens) == 8 * 12
    assert sum(records) == len(tokens) and len(records) * 2 <= len(tokens)
    assert max(records) == 8


async def test_only_a_runs_first_and_last_chunks_carry_the_stamps() -> None:
    chunks, _ = await _written(streams=8)
    assert len(chunks) >= 4
    first, *middle, last = chunks
    assert "gateway" in first["envelope"]["stamps"] and last["finish_reason"] is not None
    assert last["envelope"]["stamps"] == first["envelope"]["stamps"]
    assert all(c["envelope"]["stamps"] == {} for c in middle)
    # the rest of the envelope (the reply address, the trace) travels with every chunk
    assert all(c["envelope"] == {**first["envelope"], "stamps": c["envelope"]["stamps"]}
               for c in chunks)


async def test_images_are_read_back_for_an_engine_that_sees_them_and_refused_by_others(
        tmp_path: Any) -> None:
    import hashlib

    import pytest

    from conveyor.errors import InvalidRequest
    from conveyor.files.images import ImageStore
    from conveyor.files.local import LocalFileStore
    from conveyor.settings import load_settings
    from tests.support.images import image_bytes
    from workers.infer.engines.openai_http import OpenAIHttpEngine
    from workers.infer.engines.scripted import ScriptedEngine
    from workers.infer.generation import TaskRun

    settings = load_settings(files_dir=tmp_path)
    png = image_bytes()
    digest = hashlib.sha256(png).hexdigest()
    file_id = await ImageStore(LocalFileStore(settings.jobs)).put("acme", png, "image/png",
                                                                  digest)
    made = task(prompt_text=None)
    made["envelope"]["tenant"] = "acme"
    made["generation"]["messages"] = [{
        "role": "user", "content": "What?", "name": None, "images": [{
            "file_id": file_id, "media_type": "image/png", "bytes": len(png), "sha256": digest,
            "width": 3, "height": 2, "offset": 5, "part": "messages[0].content[1]"}]}]
    request = request_from_task(made, "", 0, None)

    text_only = TaskRun(settings, ScriptedEngine("echo"), None, "w0", made, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="does not read images") as caught:
        text_only._check(request)
    assert caught.value.param == "messages[0].content[1]"

    seeing = TaskRun(settings, OpenAIHttpEngine("http://127.0.0.1:9"), None, "w0", made,
                     None)  # type: ignore[arg-type]
    seeing._check(request)
    resolved = await seeing._with_images(request)
    assert resolved.images == {digest: png} and hashlib.sha256(png).hexdigest() == digest
    made["envelope"]["tenant"] = "globex"  # another tenant's request cannot name it
    with pytest.raises(InvalidRequest, match="no longer in the file store"):
        await seeing._with_images(request)
