"""What only the vLLM engine has, on vLLM's async engine with SmolLM2 in float32:
streaming one step at a time, an abort that frees vLLM's sequence, seeds,
prefix caching visible in the last piece, one greedy answer whatever runs
beside it, and the engines table's flags. The contract every engine keeps runs
in test_contract.py."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from conveyor.errors import EngineError
from conveyor.registry import Registry
from conveyor.settings import load_settings
from tests.engines.workers.infer.engines.test_contract import collect, request, text
from workers.infer.engines.base import Piece
from workers.infer.engines.table import EngineOptions
from workers.infer.engines.vllm import VllmEngine

# greedy SmolLM2 in float32 answers the contract's question in 8 tokens and stops;
# asked to count on, it does not stop within 400 tokens
COUNTING = request(kind="completion", prompt_text="1, 2, 3, 4, 5,", messages=(), max_tokens=400)
# about 600 tokens that two prompts share before their questions differ
SHARED = ("Conveyor is an OpenAI-compatible gateway over Apache Kafka. Every request is an "
          "event in a durable log, and every layer is a consumer group. " * 24)


def chat(question: str, system: str = "You are a helpful assistant.") -> str:
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


async def unfinished(engine: VllmEngine, within_s: float = 5.0) -> int:
    """vLLM's unfinished requests, once they are gone (or after ``within_s``)."""
    for _ in range(int(within_s / 0.05)):
        if not engine.llm.get_num_unfinished_requests():
            break
        await asyncio.sleep(0.05)
    return int(engine.llm.get_num_unfinished_requests())


async def timed(engine: VllmEngine, prompt: str, max_tokens: int) -> tuple[float, list[Piece]]:
    """Time to the first piece, and every piece."""
    started = time.monotonic()
    first = 0.0
    pieces: list[Piece] = []
    async for piece in engine.generate(request(kind="completion", prompt_text=prompt,
                                               messages=(), max_tokens=max_tokens)):
        first = first or time.monotonic() - started
        pieces.append(piece)
    return first, pieces


async def test_pieces_stream_one_step_at_a_time(vllm_engine: VllmEngine) -> None:
    arrivals: list[float] = []
    pieces: list[Piece] = []
    async for piece in vllm_engine.generate(replace(COUNTING, max_tokens=30)):
        arrivals.append(time.monotonic())
        pieces.append(piece)

    assert sum(p.tokens for p in pieces) == 30 and pieces[-1].finish_reason == "length"
    assert len(pieces) >= 20  # about one piece per token, not one piece at the end
    assert arrivals[-1] - arrivals[0] > 0.2
    tokenizer = vllm_engine.llm.get_tokenizer()
    assert pieces[-1].prompt_tokens == len(tokenizer.encode(COUNTING.prompt_text))
    assert all(p.prompt_tokens is None for p in pieces[:-1])


async def test_closing_a_generation_aborts_its_sequence_in_vllm(vllm_engine: VllmEngine) -> None:
    pieces = vllm_engine.generate(COUNTING)
    await anext(pieces)
    assert vllm_engine.llm.get_num_unfinished_requests() == 1
    await pieces.aclose()

    assert await unfinished(vllm_engine) == 0
    assert vllm_engine.running == 0


async def test_a_cancelled_consumer_aborts_its_sequence_in_vllm(vllm_engine: VllmEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _piece in vllm_engine.generate(COUNTING):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=30)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

    assert await unfinished(vllm_engine) == 0
    assert vllm_engine.running == 0


async def test_a_seed_gives_one_sample_whatever_runs_beside_it(vllm_engine: VllmEngine) -> None:
    seeded = request(temperature=1.0, seed=7, max_tokens=16)
    alone = text(await collect(vllm_engine, seeded))
    beside, _other = await asyncio.gather(
        collect(vllm_engine, seeded),
        collect(vllm_engine, request(prompt_text=chat("Write a poem."), temperature=1.0,
                                     max_tokens=24)))

    assert text(beside) == alone
    others = [text(await collect(vllm_engine, request(temperature=1.0, seed=s, max_tokens=16)))
              for s in (8, 9, 10)]
    assert any(o != alone for o in others)


async def test_temperature_zero_gives_one_answer_whatever_runs_beside_it(
        vllm_engine: VllmEngine) -> None:
    question = request(max_tokens=16)
    answers = {text(await collect(vllm_engine, question))}
    for i in range(10):  # beside a different prompt each time, cached prefix or not
        neighbour = request(prompt_text=chat(f"Count to {i + 3}."), max_tokens=12 + i)
        ours, _theirs = await asyncio.gather(collect(vllm_engine, question),
                                             collect(vllm_engine, neighbour))
        answers.add(text(ours))

    assert len(answers) == 1, answers


async def test_a_shared_prefix_is_served_from_the_cache(vllm_engine: VllmEngine) -> None:
    await vllm_engine.llm.reset_prefix_cache()
    cold_ttft, cold = await timed(vllm_engine, chat("What is Kafka?", SHARED), 4)
    warm_ttft, warm = await timed(vllm_engine, chat("What is a consumer group?", SHARED), 4)
    prompt_tokens = warm[-1].prompt_tokens or 0
    cached = warm[-1].cached_tokens or 0
    print(f"TTFT over a {prompt_tokens}-token prompt: {cold_ttft * 1000:.0f} ms cold, "
          f"{warm_ttft * 1000:.0f} ms with {cached} tokens from the prefix cache")

    assert cold[-1].cached_tokens == 0
    assert prompt_tokens > 500
    assert prompt_tokens - 32 <= cached < prompt_tokens  # all the shared blocks
    again_ttft, again = await timed(vllm_engine, chat("What is Kafka?", SHARED), 4)
    assert text(again) == text(cold)  # the cache changes the time, not the answer


async def test_a_prefix_serves_only_prompts_of_its_tenant_s_salt(
        vllm_engine: VllmEngine) -> None:
    """The request's cache_salt reaches vLLM: the same prompt under another
    salt (another tenant's, or none) finds none of its blocks, under its own
    it finds them all."""
    await vllm_engine.llm.reset_prefix_cache()

    async def cached(question: str, salt: str) -> int:
        pieces = await collect(vllm_engine, request(
            kind="completion", prompt_text=chat(question, SHARED), messages=(), max_tokens=2,
            cache_salt=salt))
        assert (pieces[-1].prompt_tokens or 0) > 500
        return pieces[-1].cached_tokens or 0

    assert await cached("What is Kafka?", "tenant-a") == 0
    assert await cached("What is Kafka?", "tenant-b") == 0  # A's prompt, B's salt
    assert await cached("What is Kafka?", "") == 0  # nor a prompt without one
    assert await cached("What is a consumer group?", "tenant-a") > 500  # A's own prefix
    assert await cached("What is a topic?", "tenant-b") > 500


async def test_the_kv_state_is_vllms_own(vllm_engine: VllmEngine) -> None:
    """What the heartbeat carries: vLLM's blocks (128 tokens each on the CPU build,
    some 90 of them in the test's KV space), the share in use, and the prompt
    tokens its prefix cache was asked for and held."""
    before = vllm_engine.kv_state()
    await timed(vllm_engine, chat("What is a topic?", SHARED), 2)
    await timed(vllm_engine, chat("What is a partition?", SHARED), 2)  # the shared prefix
    state = vllm_engine.kv_state()
    assert state is not None and state["block_tokens"] in (16, 128)  # vLLM's GPU, CPU block
    assert state["total_blocks"] * state["block_tokens"] >= 8192
    assert 0.0 <= state["usage"] < 1.0 and state["cached_blocks"] is None
    used = round(state["usage"] * state["total_blocks"])
    assert state["free_blocks"] == state["total_blocks"] - used
    queried = state["prefix_queries"] - (before["prefix_queries"] if before else 0)
    found = state["prefix_hits"] - (before["prefix_hits"] if before else 0)
    assert queried > 500 and found > 0, (queried, found)


async def test_a_prompt_beyond_max_model_len_is_an_engine_error(vllm_engine: VllmEngine) -> None:
    too_long = "word " * (vllm_engine.max_model_len + 10)
    with pytest.raises(EngineError, match="refused the prompt"):
        await collect(vllm_engine, request(kind="completion", prompt_text=too_long, messages=()))
    assert vllm_engine.running == 0


async def test_close_while_a_generation_waits_for_a_slot(
        vllm_engines: Callable[..., Awaitable[VllmEngine]]) -> None:
    """Close, with one generation running and one waiting for its slot, ends
    both with an engine error. It is also the contract's test of close
    (test_close_ends_a_running_generation_with_an_engine_error: the running
    generation, drained while close runs, ends with an engine error, and close
    returns), on the same engine of its own: each engine a test closes costs the
    tier a vLLM start (some 21 s), so test_contract.py leaves that one out."""
    engine = await vllm_engines(1)
    running = engine.generate(COUNTING)
    await anext(running)
    waiting: AsyncGenerator[Piece, None] = engine.generate(request(max_tokens=3))
    queued = asyncio.create_task(anext(waiting))
    await asyncio.sleep(0.2)
    closing = asyncio.create_task(engine.close())

    async def drain() -> None:
        async for _piece in running:
            pass

    with pytest.raises(EngineError, match="cancelled"):
        await asyncio.wait_for(drain(), timeout=10)
    await asyncio.wait_for(closing, timeout=10)
    with pytest.raises(EngineError, match="cancelled"):
        await asyncio.wait_for(queued, timeout=10)


def test_the_engines_table_makes_it_from_its_flags() -> None:
    parser = argparse.ArgumentParser()
    EngineOptions.add_flags(parser)
    args = parser.parse_args(["--engine", "vllm", "--contexts", "6", "--dtype", "bfloat16",
                              "--max-model-len", "1024", "--kv-cache-gib", "0.25",
                              "--vllm-model", "/models/smollm2"])
    registry = Registry.load(Path("conveyor/models.toml"))
    engine = EngineOptions.from_args(args).make(registry, load_settings())

    assert isinstance(engine, VllmEngine)
    assert (engine.capacity, engine.dtype, engine.max_model_len, engine.kv_cache_gib) == (
        6, "bfloat16", 1024, 0.25)
    assert engine.model == Path("/models/smollm2")
    assert engine.spec.name == "smollm2-135m-instruct"


async def test_a_schema_holds_the_answer_and_json_object_makes_an_object(
        vllm_engine: VllmEngine) -> None:
    import json

    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["cities"],
              "properties": {"cities": {"type": "array", "minItems": 2, "maxItems": 3,
                                        "items": {"type": "string", "maxLength": 20}}}}
    held = request(prompt_text=chat("Name two cities of France as JSON."), max_tokens=120,
                   response_format={"type": "json_schema", "name": "cities",
                                    "schema": json.dumps(schema), "strict": True})
    pieces = await collect(vllm_engine, held)
    assert pieces[-1].finish_reason == "stop", text(pieces)
    jsonschema.validate(json.loads(text(pieces)), schema)
    anything = replace(held, response_format={"type": "json_object", "name": "", "schema": "",
                                              "strict": False})
    pieces = await collect(vllm_engine, anything)
    assert pieces[-1].finish_reason == "stop", text(pieces)
    assert isinstance(json.loads(text(pieces)), dict)


async def test_a_structured_answer_another_run_began_is_an_engine_error(
        vllm_engine: VllmEngine) -> None:
    """vLLM's structured outputs start at the schema's beginning (vllm.structured_outputs)."""
    continued = request(prompt_text=chat("Any JSON."), max_tokens=20, continuation='{"a": ',
                        response_format={"type": "json_object", "name": "", "schema": "",
                                         "strict": False})
    with pytest.raises(EngineError, match="cannot continue a structured answer"):
        await collect(vllm_engine, continued)


async def test_tools_hold_the_answer_to_calls_of_the_functions(vllm_engine: VllmEngine) -> None:
    """A required call, through vLLM's structured outputs with the tools' grammar."""
    import json

    import jsonschema

    from schemas.openai.requests import ChatCompletionRequest
    from schemas.tool_calls import read_tool_calls
    from schemas.tools import tool_format, tool_messages

    parameters = {"type": "object", "additionalProperties": False, "required": ["city"],
                  "properties": {"city": {"type": "string", "maxLength": 20}}}
    body = ChatCompletionRequest.model_validate({
        "model": "smollm2", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                    "parameters": parameters}}],
        "tool_choice": "required", "parallel_tool_calls": False})
    tools = body.tools_record()
    assert tools is not None
    [system, user] = tool_messages([{"role": "user", "content": "Weather in Paris?",
                                     "name": None}], tools)
    held = request(prompt_text=chat(user["content"], system=system["content"]),
                   max_tokens=80, response_format=tool_format(tools))
    pieces = await collect(vllm_engine, held)
    assert pieces[-1].finish_reason == "stop", text(pieces)
    [call] = read_tool_calls("r", text(pieces)).tool_calls
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)


async def test_a_logit_bias_forces_its_token(vllm_engine: VllmEngine) -> None:
    from llama_cpp import Llama

    spec = Registry.load(Path("conveyor/models.toml")).resolve("smollm2")
    vocab = Llama(model_path=str(spec.gguf_path()), vocab_only=True, verbose=False)
    [forced] = vocab.tokenize(b" Paris", add_bos=False)
    pieces = await collect(vllm_engine, request(kind="completion", messages=(), max_tokens=4,
                                                prompt_text="The capital of France is",
                                                logit_bias=((forced, 100.0),)))
    assert text(pieces) == " Paris" * 4


async def test_logprobs_are_vllms_and_the_greedy_token_is_the_likeliest(
        vllm_engine: VllmEngine) -> None:
    pieces = await collect(vllm_engine, request(
        kind="completion", messages=(), max_tokens=6, prompt_text="The capital of France is",
        logprobs=True, top_logprobs=3))
    entries = [e for p in pieces for e in p.logprobs]
    assert len(entries) == 6 and "".join(e["token"] for e in entries) == text(pieces)
    for e in entries:
        assert e["logprob"] <= 0 and len(e["top"]) == 3
        assert e["top"][0]["token"] == e["token"]
