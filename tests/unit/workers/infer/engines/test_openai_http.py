"""OpenAIHttpEngine against a real (tiny) OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import base64
import re
import socket
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from conveyor.errors import EngineError
from conveyor.registry import Registry
from conveyor.settings import load_settings
from schemas.records import Message
from workers.infer.engines.base import GenerationRequest, Piece
from workers.infer.engines.openai_http import OpenAIHttpEngine
from workers.infer.engines.table import EngineOptions

if TYPE_CHECKING:  # the fixture's type; conftest is not importable at run time
    from conftest import FakeUpstream

EngineFactory = Callable[..., Awaitable[OpenAIHttpEngine]]
QUESTION: tuple[Message, ...] = ({"role": "user", "content": "What is the capital of France?"},)


@pytest.fixture
def engine_factory(started_engines: Callable[[Any], Awaitable[Any]]) -> EngineFactory:
    async def make(base_url: str, **kwargs: Any) -> OpenAIHttpEngine:
        engine: OpenAIHttpEngine = await started_engines(OpenAIHttpEngine(base_url, **kwargs))
        return engine

    return make


def request(**overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = {"request_id": "r1", "kind": "chat", "model": "smollm2-135m-instruct",
                              "max_tokens": 16, "messages": QUESTION}
    fields.update(overrides)
    return GenerationRequest(**fields)


async def collect(engine: OpenAIHttpEngine, req: GenerationRequest) -> list[Piece]:
    return [piece async for piece in engine.generate(req)]


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def test_completion_streams_tokens_in_order(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    fake_upstream.token_delay_s = 0.05  # a paced upstream
    engine = await engine_factory(fake_upstream.base_url)
    pieces = await collect(engine, request(kind="completion", prompt_text="Once", max_tokens=3))

    # a token read alone is a piece of its own, but a loaded machine may read
    # two at once: the order and the sum are what hold
    assert "".join(p.text for p in pieces) == "tok0 tok1 tok2 "
    assert [p.finish_reason for p in pieces[:-1]] == [None] * (len(pieces) - 1)
    assert (pieces[-1].text, pieces[-1].finish_reason) == ("", "length")
    assert sum(p.tokens for p in pieces) == 3
    (call,) = fake_upstream.calls
    assert call.path == "/v1/completions"
    assert call.body["prompt"] == "Once"
    assert call.body["stream"] is True
    assert call.body["stream_options"] == {"include_usage": True}
    assert call.body["max_tokens"] == 3
    assert "seed" not in call.body and "stop" not in call.body


async def test_a_burst_comes_as_the_pieces_it_was_read_in_adding_up(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    """An unpaced upstream writes its whole answer at once: the deltas of one
    read are one piece, so the worker's first chunk holds the burst."""
    fake_upstream.burst, fake_upstream.answer_tokens = True, 12
    engine = await engine_factory(fake_upstream.base_url)
    req = request(kind="completion", prompt_text="Once", max_tokens=12, logprobs=True,
                  top_logprobs=1)
    pieces = await collect(engine, req)

    text = "".join(f"tok{i} " for i in range(12))
    assert [(p.text, p.tokens, p.finish_reason) for p in pieces] == [
        (text, 12, None), ("", 0, "stop")]
    assert [t["token"] for t in pieces[0].logprobs] == [f"tok{i} " for i in range(12)]


async def test_chat_without_prompt_goes_to_chat_endpoint(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    engine = await engine_factory(fake_upstream.base_url)
    req = request(upstream_model="HuggingFaceTB/SmolLM2-135M-Instruct", seed=7, stop=("\n",),
                  temperature=0.0)
    pieces = await collect(engine, req)

    assert "".join(p.text for p in pieces) == "tok0 tok1 tok2 tok3 tok4 "
    assert pieces[-1].finish_reason == "stop"
    (call,) = fake_upstream.calls
    assert call.path == "/v1/chat/completions"
    assert call.body["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert call.body["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    assert call.body["seed"] == 7 and call.body["stop"] == ["\n"]
    assert call.body["temperature"] == 0.0
    assert "continue_final_message" not in call.body


async def test_chat_with_rendered_prompt_goes_to_completions(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    engine = await engine_factory(fake_upstream.base_url)
    await collect(engine, request(prompt_text="<|im_start|>user\nHi<|im_end|>\n"))

    (call,) = fake_upstream.calls
    assert call.path == "/v1/completions"
    assert call.body["model"] == "smollm2-135m-instruct"
    assert call.body["prompt"] == "<|im_start|>user\nHi<|im_end|>\n"


async def test_continuation(fake_upstream: FakeUpstream, engine_factory: EngineFactory) -> None:
    engine = await engine_factory(fake_upstream.base_url)
    await collect(engine, request(continuation="The capital"))
    await collect(engine, request(kind="completion", prompt_text="Q: ", continuation="A: Pa"))

    chat, completion = fake_upstream.calls
    assert chat.body["messages"][-1] == {"role": "assistant", "content": "The capital"}
    assert chat.body["continue_final_message"] is True
    assert chat.body["add_generation_prompt"] is False
    assert completion.body["prompt"] == "Q: A: Pa"


async def test_token_counts_add_up_to_upstream_usage(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    fake_upstream.usage_extra = 2  # e.g. several tokens in one event
    engine = await engine_factory(fake_upstream.base_url)
    pieces = await collect(engine, request())

    assert sum(p.tokens for p in pieces) == 5 + 2
    assert pieces[-1].tokens == 2


async def test_upstream_error_becomes_engine_error(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    fake_upstream.status = 400
    engine = await engine_factory(fake_upstream.base_url)
    with pytest.raises(EngineError, match="400.*bad request from the fake"):
        await collect(engine, request())


async def test_unreachable_upstream_becomes_engine_error(engine_factory: EngineFactory) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = await engine_factory(f"http://127.0.0.1:{port}")
    with pytest.raises(EngineError):
        await collect(engine, request())


async def test_closing_early_closes_the_connection(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    fake_upstream.answer_tokens, fake_upstream.token_delay_s = 1000, 0.01
    engine = await engine_factory(fake_upstream.base_url)
    async with aclosing(engine.generate(request(max_tokens=1000))) as pieces:
        got = [await anext(pieces) for _ in range(3)]
    assert [p.text for p in got] == ["tok0 ", "tok1 ", "tok2 "]

    (call,) = fake_upstream.calls
    assert await until(lambda: call.disconnected)
    assert call.sent < 1000


async def test_connections_are_kept_alive(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    engine = await engine_factory(fake_upstream.base_url)
    await collect(engine, request())
    await collect(engine, request())

    first, second = fake_upstream.calls
    assert first.client_port == second.client_port


async def test_the_tenant_s_cache_salt_goes_to_the_upstream(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    """vLLM's server takes ``cache_salt`` on both endpoints; an empty salt (caches
    shared) is not sent (vLLM refuses one), nor any by an engine told not to."""
    engine = await engine_factory(fake_upstream.base_url)
    await collect(engine, request(cache_salt="s1"))
    await collect(engine, request(kind="completion", prompt_text="Once", cache_salt="s2"))
    await collect(engine, request())
    assert [c.body.get("cache_salt") for c in fake_upstream.calls] == ["s1", "s2", None]
    assert "cache_salt" not in fake_upstream.calls[-1].body
    quiet = await engine_factory(fake_upstream.base_url, cache_salt=False)
    await collect(quiet, request(cache_salt="s1"))
    assert "cache_salt" not in fake_upstream.calls[-1].body


async def test_generate_before_start_fails() -> None:
    engine = OpenAIHttpEngine("http://127.0.0.1:1")
    with pytest.raises(EngineError, match="not started"):
        await collect(engine, request())


async def test_logprobs_are_asked_of_the_upstream_and_read_back(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    """Chat's logprobs/top_logprobs and the legacy completions' logprobs, as an
    upstream streams them, become the pieces' tokens' log probabilities."""
    engine = await engine_factory(fake_upstream.base_url)
    chat = await collect(engine, request(max_tokens=2, logprobs=True, top_logprobs=2))
    assert fake_upstream.calls[-1].body["logprobs"] is True
    assert fake_upstream.calls[-1].body["top_logprobs"] == 2
    entries = [e for p in chat for e in p.logprobs]
    assert [(e["token"], e["logprob"]) for e in entries] == [("tok0 ", -0.25), ("tok1 ", -0.25)]
    assert [[t["token"] for t in e["top"]] for e in entries] == [["tok0 ", "other"],
                                                                 ["tok1 ", "other"]]
    assert entries[0]["bytes"] == b"tok0 " and entries[0]["top"][1]["bytes"] == b"other"
    done = await collect(engine, request(kind="completion", prompt_text="Once", max_tokens=2,
                                         logprobs=True, top_logprobs=1))
    assert fake_upstream.calls[-1].body["logprobs"] == 1
    entries = [e for p in done for e in p.logprobs]
    assert [(e["token"], [t["token"] for t in e["top"]]) for e in entries] == [
        ("tok0 ", ["tok0 "]), ("tok1 ", ["tok1 "])]
    plain = await collect(engine, request(max_tokens=2))
    assert "logprobs" not in fake_upstream.calls[-1].body and not any(p.logprobs for p in plain)


async def test_tools_are_passed_on_and_the_upstreams_calls_read_back(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    """The upstream calls functions itself: its tool_calls deltas become the text
    of Conveyor's format, which reads back as the same calls; the history's
    calls and results go to it as OpenAI's messages."""
    from schemas.openai.requests import ChatCompletionRequest
    from schemas.tool_calls import read_tool_calls
    from schemas.tools import tool_format

    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    tools = body.tools_record()
    assert tools is not None
    history = ({"role": "user", "content": "Weather?", "name": None},
               {"role": "assistant", "content": "", "name": None, "tool_call_id": None,
                "tool_calls": [{"id": "c0", "name": "get_weather", "arguments": "{}"}]},
               {"role": "tool", "content": "sunny", "name": None, "tool_calls": None,
                "tool_call_id": "c0"})
    engine = await engine_factory(fake_upstream.base_url)
    pieces = await collect(engine, request(messages=history,
                                           response_format=tool_format(tools)))
    sent = fake_upstream.calls[-1].body
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert sent["tools"][0]["function"]["name"] == "get_weather" and "response_format" not in sent
    assert sent["messages"][1]["tool_calls"][0]["id"] == "c0"
    assert sent["messages"][2]["tool_call_id"] == "c0"
    read = read_tool_calls("r1", "".join(p.text for p in pieces))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in read.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    assert read.content is None and not read.broken


@pytest.mark.parametrize(("garbage", "says"), [
    ("{not json", "unparsable"), ('{"a": NaN}', "unparsable"), ("[1, 2]", "unexpected"),
    ('"text"', "unexpected"),
])
async def test_an_event_that_is_not_a_json_object_fails_the_generation_with_what_came(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory, garbage: str, says: str
) -> None:
    fake_upstream.garbage = garbage
    engine = await engine_factory(fake_upstream.base_url)
    with pytest.raises(EngineError, match=f"upstream sent {says} data: .*{re.escape(garbage[:4])}"):
        await collect(engine, request(kind="completion", prompt_text="Once", max_tokens=3))


class ClosingUpstream:
    """An upstream on a bare socket that closes the connection of each of its
    first ``drops`` requests unanswered (a pooled connection ended as the
    request went out) and answers the others with one streamed completion."""

    ANSWER = b"".join(b"data: %s\n\n" % line for line in (
        b'{"choices": [{"index": 0, "text": "Paris", "finish_reason": null}]}',
        b'{"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}', b"[DONE]"))

    def __init__(self, drops: int) -> None:
        self.drops = drops
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                self.requests += 1
                if self.requests <= self.drops:
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(self.ANSWER), self.ANSWER))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_connection_the_upstream_closed_unanswered_is_sent_on_again_once(
    engine_factory: EngineFactory
) -> None:
    completion = request(kind="completion", prompt_text="The capital of France is")
    async with ClosingUpstream(drops=1) as base_url:
        engine = await engine_factory(base_url)
        pieces = await collect(engine, completion)
    assert "".join(p.text for p in pieces) == "Paris" and pieces[-1].finish_reason == "stop"
    async with ClosingUpstream(drops=2) as base_url:  # closed twice: the request fails
        engine = await engine_factory(base_url)
        with pytest.raises(EngineError, match="upstream"):
            await collect(engine, completion)


async def test_an_idle_connection_is_not_kept_past_the_keep_alive(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below an upstream's own keep-alive (uvicorn's and vLLM's 5 s, here a
    tenth of a second), so that no request goes out on a connection the
    upstream is closing."""
    monkeypatch.setattr("workers.infer.engines.openai_http._KEEPALIVE_S", 0.1)
    engine = await engine_factory(fake_upstream.base_url)
    await collect(engine, request())
    await asyncio.sleep(0.3)
    await collect(engine, request())
    first, second = fake_upstream.calls
    assert first.client_port != second.client_port


async def test_the_upstream_s_key_goes_as_a_bearer_token_and_none_without_one(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    keyed = await engine_factory(fake_upstream.base_url, api_key="up-key-1")
    await collect(keyed, request(max_tokens=2))
    plain = await engine_factory(fake_upstream.base_url)
    await collect(plain, request(max_tokens=2))
    assert [c.authorization for c in fake_upstream.calls] == ["Bearer up-key-1", None]


def test_the_engines_table_hands_the_openai_engine_the_key_of_the_settings() -> None:
    options = EngineOptions(engine="openai", upstream="http://127.0.0.1:9/v1")
    settings = load_settings(upstream_api_key="from-the-environment")
    engine = options.make(Registry.load(Path("conveyor/models.toml")), settings)
    assert isinstance(engine, OpenAIHttpEngine)
    assert engine._headers == {"Authorization": "Bearer from-the-environment"}


async def test_embeddings_are_passed_on_to_the_upstream_and_read_back_in_order(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    from conveyor.errors import InvalidRequest
    from workers.infer.engines.base import EmbeddingRequest

    engine = await engine_factory(fake_upstream.base_url)
    assert engine.embeds
    vectors = await engine.embed(EmbeddingRequest(
        "r1", "bge", ("a", (5, 6)), dimensions=4, upstream_model="BAAI/bge-small"))
    assert vectors.tolist() == [[0, 1, 0, 0], [1, 1, 0, 0]]  # by index, not by place
    (call,) = fake_upstream.calls
    assert call.path == "/v1/embeddings"
    assert call.body == {"model": "BAAI/bge-small", "input": ["a", [5, 6]],
                         "encoding_format": "base64", "dimensions": 4}
    fake_upstream.status = 400  # the upstream's refusal is the client's
    with pytest.raises(InvalidRequest, match="input too long") as info:
        await engine.embed(EmbeddingRequest("r2", "bge", ("x",)))
    assert info.value.param == "input"
    for status in (503, 401, 404, 429):  # not the client's body: the engine's failure
        fake_upstream.status = status
        with pytest.raises(EngineError):
            await engine.embed(EmbeddingRequest("r3", "bge", ("x",)))


async def test_images_go_as_data_urls_where_they_stood_among_the_texts(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    png, gif = b"\x89PNG fake bytes", b"GIF89a fake bytes"
    refs = [{"file_id": "file-1", "media_type": "image/png", "bytes": len(png),
             "sha256": "a" * 64, "width": 1, "height": 1, "detail": "low", "offset": 6,
             "part": "messages[0].content[1]"},
            {"file_id": "file-2", "media_type": "image/gif", "bytes": len(gif),
             "sha256": "b" * 64, "width": 1, "height": 1, "detail": "auto", "offset": 16,
             "part": "messages[0].content[3]"}]
    engine = await engine_factory(fake_upstream.base_url)
    await collect(engine, request(
        messages=({"role": "system", "content": "Look."},
                  {"role": "user", "content": "First: then this.", "images": refs}),
        images={"a" * 64: png, "b" * 64: gif}))
    (call,) = fake_upstream.calls
    assert call.path == "/v1/chat/completions"
    assert call.body["messages"] == [
        {"role": "system", "content": "Look."},
        {"role": "user", "content": [
            {"type": "text", "text": "First:"},
            {"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(png).decode(),
                "detail": "low"}},
            {"type": "text", "text": " then this"},
            {"type": "image_url", "image_url": {
                "url": "data:image/gif;base64," + base64.b64encode(gif).decode()}},
            {"type": "text", "text": "."}]}]


async def test_an_image_whose_bytes_were_not_read_fails_the_engine(
    fake_upstream: FakeUpstream, engine_factory: EngineFactory
) -> None:
    ref = {"file_id": "file-1", "media_type": "image/png", "bytes": 1, "sha256": "a" * 64,
           "width": 1, "height": 1, "offset": 0, "part": "messages[0].content[0]"}
    engine = await engine_factory(fake_upstream.base_url)
    with pytest.raises(EngineError, match=r"messages\[0\].content\[0\] was not read"):
        await collect(engine, request(messages=({"role": "user", "content": "",
                                                 "images": [ref]},)))
    assert fake_upstream.calls == []
