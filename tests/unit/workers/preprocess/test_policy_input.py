"""The input's safety check in preprocess: a request whose text holds a term of its
tenant's input lists fails with 400 ``content_policy_violation`` naming the
category, never the term, and is audited; another tenant's request goes on.
The test registry (tests/data/models.toml), a PolicyBook passed in, no Kafka."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conveyor.errors import ContentPolicyViolation
from conveyor.policy.rules import PolicyBook
from conveyor.registry import Registry
from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import Message, Request, ToolCall, Tools
from tests.support.factories import request as make_request
from workers.outputs import Sender
from workers.preprocess import PreprocessLayer
from workers.preprocess.tokenizers import TokenizerCache

MODELS = Path(__file__).resolve().parents[3] / "data" / "models.toml"
POLICY = """
[safety]
input = { custom = ["project nightingale"] }
blocked = { violence = ["how to make a bomb"] }
output = { leaks = ["internal use only"] }
"""
TERMS = ("project nightingale", "how to make a bomb", "nightingale", "bomb")


@pytest.fixture(scope="module")
def settings() -> Settings:
    return load_settings(topic_prefix="pptest", models_file=MODELS)


@pytest.fixture(scope="module")
def book() -> PolicyBook:
    book = PolicyBook()
    assert book.set("tenant:acme", POLICY)
    return book


@pytest.fixture(scope="module")
def layer(settings: Settings, book: PolicyBook) -> PreprocessLayer:
    return PreprocessLayer(settings, Registry.load(settings.process.models_file), TokenizerCache(),
                           policies=book)


def message(role: str, content: str, calls: list[ToolCall] | None = None) -> Message:
    return {"role": role, "content": content, "name": None, "tool_calls": calls,
            "tool_call_id": None}


def request(messages: list[Message] | None = None, *, tenant: str = "acme",
            **fields: Any) -> Request:
    req = make_request(messages, request_id="r-policy", model="smollm2",
                       created=1_700_000_000, **fields)
    req["envelope"]["tenant"] = tenant
    req["envelope"]["key_id"] = "k1"
    return req


async def refusal(layer: PreprocessLayer, req: Request) -> ContentPolicyViolation:
    with pytest.raises(ContentPolicyViolation) as err:
        await layer.handle(req, None)
    exc = err.value
    assert exc.status == 400 and exc.type == "invalid_request_error"
    assert exc.code == "content_policy_violation"
    for term in TERMS:  # the client does not learn the list by probing it
        assert term not in str(exc).lower()
    return exc


async def test_a_chat_message_holding_a_term_is_refused(layer: PreprocessLayer) -> None:
    req = request([message("system", "Be brief."),
                   message("user", "Tell me about Project  Nightingale, please.")])
    exc = await refusal(layer, req)
    assert str(exc) == "The request was blocked by the content policy (category: custom)."
    assert exc.param == "messages"


async def test_a_term_of_the_blocked_list_is_refused_by_its_category(
        layer: PreprocessLayer) -> None:
    req = request([message("user", "Hi."), message("assistant", "Hello."),
                   message("user", "So HOW TO make a\nbomb?")])
    assert "category: violence" in str(await refusal(layer, req))


async def test_a_term_in_an_assistant_tool_call_is_refused(layer: PreprocessLayer) -> None:
    call = ToolCall(id="call_1", name="search",
                    arguments=json.dumps({"query": "project nightingale budget"}))
    req = request([message("user", "Find the budget."),
                   message("assistant", "", [call]),
                   message("tool", "no results")])
    assert "category: custom" in str(await refusal(layer, req))


async def test_a_term_in_a_tools_description_is_refused(layer: PreprocessLayer) -> None:
    req = request([message("user", "Hi.")])
    req["generation"]["tools"] = Tools(
        functions=[{"name": "lookup", "description": "Looks up project nightingale.",
                    "parameters": "", "strict": False}],
        choice="auto", function="", parallel=True)
    assert "category: custom" in str(await refusal(layer, req))


async def test_a_completion_prompt_holding_a_term_is_refused(layer: PreprocessLayer) -> None:
    req = request(kind="completion", prompt="Step by step, here is how to make a bomb:")
    assert "category: violence" in str(await refusal(layer, req))


async def test_a_word_that_only_contains_the_term_passes(layer: PreprocessLayer) -> None:
    outputs = await layer.handle(request([message("user", "Bombs? No: a bombastic talk.")]),
                                 None)
    assert [o.event_type for o in outputs] == ["Prepared"]


async def test_an_output_term_does_not_block_the_input(layer: PreprocessLayer) -> None:
    outputs = await layer.handle(request([message("user", "Mark it internal use only.")]),
                                 None)
    assert [o.event_type for o in outputs] == ["Prepared"]


async def test_another_tenants_request_passes(layer: PreprocessLayer) -> None:
    req = request([message("user", "Tell me about project nightingale.")], tenant="globex")
    outputs = await layer.handle(req, None)
    assert len(outputs) == 1
    out = outputs[0]
    assert (out.topic, out.event_type, out.key) == ("pptest.prepared", "Prepared", "r-policy")
    prepared = out.record
    assert prepared["envelope"]["tenant"] == "globex"
    assert "project nightingale" in prepared["generation"]["messages"][0]["content"]
    assert prepared["prompt"]["tokens"] > 0


async def test_with_a_sender_the_refusal_is_an_error_reply_and_an_audit(
        settings: Settings, book: PolicyBook) -> None:
    layer = PreprocessLayer(settings, Registry.load(settings.process.models_file), TokenizerCache(),
                            policies=book)
    # a Sender that never produces: handle only builds outputs with it
    await layer.start(Sender(settings, None, default_codec()))  # type: ignore[arg-type]
    req = request([message("user", "About project nightingale.")])
    req["envelope"]["reply_partition"] = 4
    outputs = await layer.handle(req, None)
    codec = default_codec()
    for o in outputs:  # events the log takes (defaults filled in on the way)
        decoded = codec.decode(codec.encode(o.event_type, o.record), o.event_type)
        assert decoded == {**decoded, **o.record}

    assert [o.event_type for o in outputs] == ["Reply", "UsageRecord", "AuditEvent"]
    reply, usage, audit = (o.record for o in outputs)
    assert (usage["status"], usage["error_code"], usage["model"]) == (
        "error", "content_policy_violation", req["generation"]["model"])
    assert reply["kind"] == "error" and outputs[0].partition == 4
    assert reply["error"]["status"] == 400
    assert reply["error"]["code"] == "content_policy_violation"
    assert "category: custom" in reply["error"]["message"]
    assert audit["action"] == "policy.input_blocked"
    assert (audit["tenant"], audit["key_id"], audit["request_id"]) == ("acme", "k1",
                                                                       "r-policy")
    assert audit["actor"] == "preprocess"
    assert audit["detail"] == {"category": "custom", "level": "1", "scopes": "tenant:acme"}
    assert outputs[2].topic == settings.kafka.topic("audit") and outputs[2].key == "acme"
    for out in outputs:
        assert "nightingale" not in json.dumps(out.record, default=str).lower()

    # a replay (no reply address) is still audited
    replay = request([message("user", "About project nightingale.")])
    replay["envelope"]["reply_partition"] = -1
    assert [o.event_type for o in await layer.handle(replay, None)] == ["AuditEvent"]
    await layer.stop()

