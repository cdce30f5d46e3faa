"""PreprocessLayer.handle on real requests, SmolLM2's real tokenizer, no Kafka."""

from __future__ import annotations

from typing import Literal

import pytest
from aiokafka import TopicPartition
from llama_cpp import Llama

from conveyor.errors import ContextLengthExceeded, InvalidRequest
from conveyor.registry import Registry
from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import Message, Prepared, Request
from tests.support.factories import request as make_request
from topics.catalog import REQUESTS
from workers.outputs import Output
from workers.prefix import block_hashes, tenant_salt
from workers.preprocess import PreprocessLayer
from workers.preprocess.tokenizers import TokenizerCache

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def settings() -> Settings:
    return load_settings(topic_prefix="pptest")


@pytest.fixture(scope="module")
def registry(settings: Settings) -> Registry:
    return Registry.load(settings.process.models_file)


@pytest.fixture(scope="module")
def layer(settings: Settings, registry: Registry) -> PreprocessLayer:
    # One cache for the module: the GGUF vocabulary loads once.
    return PreprocessLayer(settings, registry, TokenizerCache())


@pytest.fixture(scope="module")
def llama(registry: Registry) -> Llama:
    spec = registry.resolve(MODEL)
    return Llama(model_path=str(spec.gguf_path()), vocab_only=True, verbose=False)


def message(role: str, content: str) -> Message:
    return {"role": role, "content": content, "name": None, "tool_calls": None,
            "tool_call_id": None, "images": None}


def request(
    messages: list[Message] | None = None,
    *,
    model: str = "smollm2",
    max_tokens: int | None = None,
    kind: Literal["chat", "completion"] = "chat",
    prompt: str | None = None,
    request_id: str = "r1",
) -> Request:
    return make_request(messages, request_id=request_id, model=model, max_tokens=max_tokens,
                        kind=kind, prompt=prompt, temperature=0.7, created=1_700_000_000)


async def prepare(layer: PreprocessLayer, req: Request) -> Prepared:
    outputs = await layer.handle(req, None)
    assert len(outputs) == 1
    out = outputs[0]
    assert isinstance(out, Output)
    assert out.topic == "pptest.prepared" and out.event_type == "Prepared"
    assert out.key == req["envelope"]["request_id"] and out.partition is None
    prepared: Prepared = out.record
    return prepared


def test_layer_contract(layer: PreprocessLayer) -> None:
    assert layer.name == "preprocess"
    assert layer.source is REQUESTS and layer.source.at(layer.settings.kafka) == "pptest.requests"
    assert layer.committable(TopicPartition("pptest.requests", 0), 42) == 42


async def test_chat_request_is_prepared(layer: PreprocessLayer, llama: Llama) -> None:
    req = request([message("system", "Be brief."), message("user", "What is Kafka?")])
    prepared = await prepare(layer, req)

    assert "preprocess" in prepared["envelope"]["stamps"]
    assert prepared["envelope"]["request_id"] == "r1"
    prompt = prepared["prompt"]
    assert prompt["text"] == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is Kafka?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt["text"].endswith("<|im_start|>assistant\n")
    expected = len(llama.tokenize(prompt["text"].encode(), add_bos=False, special=True))
    assert prompt["tokens"] == expected and prompt["exact"] is True
    assert prompt["max_tokens"] == 256  # the registry's default_max_tokens
    assert prompt["dropped_messages"] == 0
    assert len(prompt["fingerprint"]) == 32
    assert prepared["generation"]["messages"] == req["generation"]["messages"]


async def test_messages_are_nfc_normalised(layer: PreprocessLayer) -> None:
    prepared = await prepare(layer, request([message("user", "caf" + "e\u0301")]))
    assert prepared["generation"]["messages"][0]["content"] == "caf\u00e9"
    assert prepared["prompt"]["text"] is not None
    assert "caf\u00e9" in prepared["prompt"]["text"]


async def test_bad_role_rejected_with_param(layer: PreprocessLayer) -> None:
    req = request([message("user", "hi"), message("robot", "beep")])
    with pytest.raises(InvalidRequest) as err:
        await layer.handle(req, None)
    assert err.value.param == "messages[1].role"


async def test_tool_turns_are_rendered_where_the_template_is_known(
        layer: PreprocessLayer) -> None:
    """SmolLM2's template renders here: the tools and the history's calls become
    plain turns (schemas/tools.py); a model whose engine renders for itself (an
    upstream's) keeps them as they are, to be sent on."""
    calls = [{"id": "c1", "name": "now", "arguments": "{}"}]
    history = [message("user", "Time?"), {**message("assistant", ""), "tool_calls": calls},
               {**message("tool", "noon"), "tool_call_id": "c1"}]
    tools = {"functions": [{"name": "now", "description": "", "parameters": "",
                            "strict": False}], "choice": "auto", "function": "",
             "parallel": True}
    req = request(history)  # type: ignore[arg-type]
    req["generation"]["tools"] = tools  # type: ignore[typeddict-item]
    rendered = (await prepare(layer, req))["generation"]["messages"]
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert "<tool_call>" in rendered[2]["content"] and rendered[2]["tool_calls"] is None
    req = request(history, model="phantom")  # type: ignore[arg-type]
    req["generation"]["tools"] = tools  # type: ignore[typeddict-item]
    kept = (await prepare(layer, req))["generation"]["messages"]
    assert [m["role"] for m in kept] == ["user", "assistant", "tool"]
    assert kept[1]["tool_calls"] == calls and kept[2]["tool_call_id"] == "c1"


async def test_a_logit_bias_outside_the_vocabulary_is_rejected(layer: PreprocessLayer,
                                                               llama: Llama) -> None:
    req = request([message("user", "hi")])
    req["generation"]["sampling"]["logit_bias"] = {"42": -100.0, str(llama.n_vocab()): 1.0}
    with pytest.raises(InvalidRequest) as err:
        await layer.handle(req, None)
    assert err.value.param == "logit_bias" and str(llama.n_vocab()) in err.value.message
    req["generation"]["sampling"]["logit_bias"] = {str(llama.n_vocab() - 1): 1.0}
    assert (await prepare(layer, req))["generation"]["sampling"]["logit_bias"]
    unknown = request([message("user", "hi")], model="no-such-model")
    unknown["generation"]["sampling"]["logit_bias"] = {"99999999": 1.0}
    await prepare(layer, unknown)  # its vocabulary is not known here: route answers 404


async def test_empty_messages_rejected(layer: PreprocessLayer) -> None:
    with pytest.raises(InvalidRequest) as err:
        await layer.handle(request([]), None)
    assert err.value.param == "messages"


async def test_long_conversation_is_trimmed(layer: PreprocessLayer) -> None:
    body = " ".join(f"item{j} lorem ipsum dolor" for j in range(30))
    messages = [message("system", "You are a patient tutor.")]
    for i in range(40):
        messages.append(message("user" if i % 2 == 0 else "assistant", f"#{i} {body}"))
    messages.append(message("user", "Summarise, please."))

    prepared = await prepare(layer, request(messages, max_tokens=200))

    kept = prepared["generation"]["messages"]
    dropped = prepared["prompt"]["dropped_messages"]
    assert dropped > 0 and len(kept) == len(messages) - dropped
    assert kept[0]["content"] == "You are a patient tutor."
    assert kept[-1]["content"] == "Summarise, please."
    assert kept[1:] == messages[1 + dropped:]
    assert "#0 " not in (prepared["prompt"]["text"] or "")
    assert prepared["prompt"]["tokens"] + 200 <= 2048
    assert prepared["prompt"]["max_tokens"] == 200


async def test_huge_history_is_trimmed_off_the_event_loop(layer: PreprocessLayer) -> None:
    messages = [message("system", "Be terse.")]
    for i in range(400):
        messages.append(message("user" if i % 2 == 0 else "assistant", f"#{i} " * 60))
    messages.append(message("user", "Last one."))
    assert sum(len(m["content"]) for m in messages) > 32_768  # the threaded path

    prepared = await prepare(layer, request(messages))

    kept = prepared["generation"]["messages"]
    assert kept[0] == messages[0] and kept[-1] == messages[-1]
    assert prepared["prompt"]["dropped_messages"] == len(messages) - len(kept) > 300
    assert prepared["prompt"]["tokens"] + prepared["prompt"]["max_tokens"] <= 2048


async def test_single_huge_message_exceeds_context(layer: PreprocessLayer) -> None:
    req = request([message("system", "s"), message("user", "tokens galore " * 2000)])
    with pytest.raises(ContextLengthExceeded) as err:
        await layer.handle(req, None)
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert "maximum context length is 2048 tokens" in err.value.message


async def test_max_tokens_too_big_exceeds_context(layer: PreprocessLayer) -> None:
    req = request([message("user", "hi")], max_tokens=2048)
    with pytest.raises(ContextLengthExceeded) as err:
        await layer.handle(req, None)
    assert "2048 in the completion" in err.value.message


async def test_completion_request(layer: PreprocessLayer) -> None:
    prepared = await prepare(
        layer, request(kind="completion", prompt="Once upon a time", max_tokens=16)
    )
    prompt = prepared["prompt"]
    assert prompt["text"] == "Once upon a time" and prompt["max_tokens"] == 16
    assert prompt["exact"] is True and prompt["tokens"] > 0


async def test_alias_and_name_share_a_fingerprint(layer: PreprocessLayer) -> None:
    messages = [message("user", "Same prompt")]
    by_alias = await prepare(layer, request(messages, model="smollm2"))
    by_name = await prepare(layer, request(messages, model=MODEL))
    other = await prepare(layer, request([message("user", "Other prompt")]))
    assert by_alias["prompt"]["fingerprint"] == by_name["prompt"]["fingerprint"]
    assert by_alias["prompt"]["fingerprint"] != other["prompt"]["fingerprint"]
    assert by_alias["generation"]["model"] == "smollm2"  # route resolves aliases


async def test_unknown_model_passes_through(layer: PreprocessLayer) -> None:
    huge = "x" * 100_000  # far beyond any context: not checked here
    prepared = await prepare(layer, request([message("user", huge)], model="no-such-model"))
    prompt = prepared["prompt"]
    assert prompt["exact"] is False and prompt["text"] is None
    assert prompt["tokens"] >= 25_000 and prompt["dropped_messages"] == 0
    assert prompt["max_tokens"] == 256
    assert prepared["generation"]["model"] == "no-such-model"


async def test_unknown_model_still_validated(layer: PreprocessLayer) -> None:
    with pytest.raises(InvalidRequest):
        await layer.handle(request([message("nobody", "hi")], model="no-such-model"), None)


async def test_redelivery_is_idempotent(layer: PreprocessLayer) -> None:
    req = request([message("user", "again")])
    first = await prepare(layer, req)
    second = await prepare(layer, req)
    assert first["prompt"] == second["prompt"]
    assert first["envelope"]["stamps"] == second["envelope"]["stamps"]


async def test_prepared_round_trips_through_the_codec(layer: PreprocessLayer) -> None:
    codec = default_codec()
    for req in (
        request([message("system", "S"), message("user", "h\u00e9llo")], max_tokens=32),
        request(kind="completion", prompt="abc"),
        request([message("user", "hi")], model="no-such-model"),
    ):
        prepared = await prepare(layer, req)
        data = codec.encode("Prepared", prepared)
        assert codec.decode(data, "Prepared") == prepared


async def test_a_conversation_s_turns_share_their_leading_prompt_blocks(
        layer: PreprocessLayer, llama: Llama) -> None:
    """The blocks are the chained hashes of the rendered prompt's tokens, 64 a
    block: the next turn of a conversation begins with the blocks of the last."""
    system = message("system", "You answer questions about the history of ships. " * 20)
    one = await prepare(layer, request([system, message("user", "Who built the first?")]))
    two = await prepare(layer, request([system, message("user", "Who built the first?"),
                                        message("assistant", "The Egyptians, probably."),
                                        message("user", "And the largest?")]))
    text = one["prompt"]["text"]
    assert text is not None
    ids = llama.tokenize(text.encode(), add_bos=False, special=True)
    blocks = one["prompt"]["prefix_blocks"]
    assert len(blocks) == len(ids) // 64 >= 3
    assert blocks == block_hashes(ids, 64, 256, tenant_salt("default"))  # its tenant's chain
    assert two["prompt"]["prefix_blocks"][:len(blocks) - 1] == blocks[:-1]
    other = await prepare(layer, request([message("user", "Something else entirely.")]))
    assert other["prompt"]["prefix_blocks"] == []  # shorter than one block


async def test_two_tenants_identical_prompts_share_no_block(
        layer: PreprocessLayer, settings: Settings, registry: Registry) -> None:
    """Each tenant's chain begins with its salt, so schedule never takes one
    tenant's prompt for another's; with prefix_cache_shared, one chain for all."""
    system = message("system", "You answer questions about the history of ships. " * 20)

    def asked_by(tenant: str) -> Request:
        req = request([system, message("user", "Who built the first?")])
        req["envelope"]["tenant"] = tenant
        return req

    a = (await prepare(layer, asked_by("acme")))["prompt"]["prefix_blocks"]
    b = (await prepare(layer, asked_by("globex")))["prompt"]["prefix_blocks"]
    assert len(a) == len(b) >= 3 and not set(a) & set(b)
    assert (await prepare(layer, asked_by("acme")))["prompt"]["prefix_blocks"] == a
    shared = PreprocessLayer(settings.replace(prefix_cache_shared=True),
                             registry, layer.tokenizers)
    one = (await prepare(shared, asked_by("acme")))["prompt"]["prefix_blocks"]
    assert one == (await prepare(shared, asked_by("globex")))["prompt"]["prefix_blocks"]
    assert len(one) == len(a) and not set(one) & set(a)


async def test_a_long_text_s_blocks_are_those_of_its_beginning(layer: PreprocessLayer) -> None:
    """Only the first blocks are hashed, from no more text than they need."""
    words = " ".join(f"w{i}" for i in range(12_000))
    tokenizer = await layer.tokenizers.get(layer.registry.resolve(MODEL))
    whole = tokenizer.ids(words, 10**6)
    assert tokenizer.ids(words, 100) == whole[:100]
    assert block_hashes(tokenizer.ids(words, 64 * 4), 64, 4) == block_hashes(whole, 64, 4)


async def test_a_model_without_a_local_tokenizer_gets_no_blocks(layer: PreprocessLayer) -> None:
    prepared = await prepare(layer, request([message("user", "x " * 500)], model="no-such-model"))
    assert prepared["prompt"]["prefix_blocks"] == []
