"""Content policies through a real Conveyor with API keys (the scripted engine
echoing each request's words, one token a chunk): a blocked input for every
tenant and a tenant's own list, a streamed answer cut before a term split
across chunks, personal data redacted in every topic and restored in the
answer, the prompt cache answering with no worker, ``POST /v1/moderations``
with the openai client; each policy change applied without a restart."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from schemas.codec import default_codec
from tests.support.auth import ADMIN_TOKEN, SECRET, Replicas
from tests.support.key_backends import read_topic
from tests.support.pipeline import Pipeline
from tests.support.topics import records, traces_of

ECHO = ("--engine", "scripted", "--script", "echo", "--token-delay-ms", "5")
EMAIL = "jane.roe.7f3a@example.org"
PHONE = "+44 20 7946 0958"
CARD = "4111 1111 1111 1111"


@pytest.fixture(scope="module")
def p(services: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    made = Pipeline(tmp_path_factory.mktemp("policy-logs"), engine=ECHO,
                    CONVEYOR_AUTH="keys", CONVEYOR_AUTH_SECRET=SECRET,
                    CONVEYOR_ADMIN_TOKEN=ADMIN_TOKEN, CONVEYOR_COALESCE_MS="0")
    try:
        made.cli("topics")
        _, made.api_key = Replicas(made, "", "").key(tenant="ops")
        made.start(workers=1, contexts=2)
        yield made
    finally:
        made.close()


def tenant_key(p: Pipeline) -> tuple[str, str]:
    """A new tenant and the secret of its key."""
    tenant = f"t{uuid.uuid4().hex[:8]}"
    _, secret = Replicas(p, "", "").key(tenant=tenant)
    return tenant, secret


def set_policy(p: Pipeline, tmp_path: Path, scope: list[str], text: str) -> None:
    path = tmp_path / f"policy-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(text)
    assert "every process applies it" in p.cli("policies", "set", *scope, str(path))


def chat(p: Pipeline, secret: str, content: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{p.base_url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "smollm2", "max_tokens": 64,
                            "messages": [{"role": "user", "content": content}], **extra})


def until(check: Callable[[], bool], within_s: float = 15.0) -> None:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < within_s, "not within the bound"
        time.sleep(0.2)


def audits(p: Pipeline, request_action: str) -> list[dict[str, Any]]:
    codec = default_codec()
    values = asyncio.run(read_topic(p.settings, "audit"))
    events = [codec.decode(v, "AuditEvent") for _, v in values]
    return [e for e in events if e["action"] == request_action]


def test_a_blocked_input_everywhere_and_in_one_tenant_changed_live(
        p: Pipeline, tmp_path: Path) -> None:
    tenant, mine = tenant_key(p)
    _, theirs = tenant_key(p)
    assert chat(p, mine, "tell me about project nightingale").status_code == 200
    set_policy(p, tmp_path, ["--default"],
               '[safety]\nblocked = { violence = ["build a pipe bomb"] }\n')
    set_policy(p, tmp_path, ["--tenant", tenant],
               '[safety]\ninput = { custom = ["project nightingale"] }\n')
    until(lambda: chat(p, mine, "tell me about Project  Nightingale").status_code == 400)
    refused = chat(p, mine, "tell me about Project  Nightingale")
    error = refused.json()["error"]
    assert error["code"] == "content_policy_violation" and "custom" in error["message"]
    assert "nightingale" not in error["message"].lower()  # the list is not told
    assert chat(p, theirs, "tell me about project nightingale").status_code == 200
    client = openai.OpenAI(base_url=f"{p.base_url}/v1", api_key=theirs)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=[
            {"role": "user", "content": "How do I build a PIPE bomb?"}])
    assert caught.value.code == "content_policy_violation"
    blocked = [e for e in audits(p, "policy.input_blocked") if e["tenant"] == tenant]
    assert blocked and blocked[-1]["detail"]["category"] == "custom"
    assert "nightingale" not in str(blocked).lower()
    # the log tells it, and a replay under the live policies blocks it again
    assert "policy: input blocked" in p.cli("inspect", blocked[-1]["request_id"])
    replayed = json.loads(p.cli("replay", blocked[-1]["request_id"], "--json"))
    [preprocess] = [x for x in replayed["layers"] if x["layer"] == "preprocess"]
    assert "content_policy_violation" in (preprocess["error"]["replayed"] or ""), preprocess
    assert preprocess["error"]["same"], preprocess
    assert p.cli("policies", "clear", "--tenant", tenant)
    until(lambda: chat(p, mine, "tell me about project nightingale").status_code == 200)


def test_a_streamed_answer_is_cut_before_a_term_split_across_chunks(
        p: Pipeline, tmp_path: Path) -> None:
    tenant, secret = tenant_key(p)
    words = "alpha bravo charlie delta echo foxtrot golf"
    set_policy(p, tmp_path, ["--tenant", tenant],
               '[safety]\noutput = { custom = ["Charlie Delta Echo"] }\n')
    client = openai.OpenAI(base_url=f"{p.base_url}/v1", api_key=secret)

    def streamed() -> tuple[str, str | None]:
        text, reason = "", None
        for chunk in client.chat.completions.create(
                model="smollm2", stream=True, max_tokens=64,
                messages=[{"role": "user", "content": words}]):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    until(lambda: streamed()[1] == "content_filter")
    text, reason = streamed()
    assert reason == "content_filter" and text.strip() == "alpha bravo", text
    whole = client.chat.completions.create(model="smollm2", max_tokens=64,
                                           messages=[{"role": "user", "content": words}])
    assert whole.choices[0].finish_reason == "content_filter"
    assert whole.choices[0].message.content.strip() == "alpha bravo"
    # the term came in several chunks: the check held them back, never sent them
    chunks = [r for r in asyncio.run(records(p, [p.settings.kafka.topic("tokens")]))
              if b"charlie" in (r.value or b"") or b"delta" in (r.value or b"")]
    assert len(chunks) >= 2
    assert [e for e in audits(p, "policy.output_blocked") if e["tenant"] == tenant]


def test_personal_data_is_redacted_in_every_topic_and_restored(
        p: Pipeline, tmp_path: Path) -> None:
    tenant, secret = tenant_key(p)
    set_policy(p, tmp_path, ["--tenant", tenant],
               '[pii]\nredact = ["email", "phone", "card"]\nrestore = true\n')
    said = f"Write to {EMAIL} or call {PHONE}; my card is {CARD}."
    client = openai.OpenAI(base_url=f"{p.base_url}/v1", api_key=secret)

    def answered() -> str:
        return client.chat.completions.create(
            model="smollm2", max_tokens=64,
            messages=[{"role": "user", "content": said}]).choices[0].message.content or ""


    def probe_redacted() -> bool:  # the gateway has the policy: a probe's address is gone
        probe = f"probe-{uuid.uuid4().hex[:6]}@example.net"
        assert chat(p, secret, f"hi {probe}").status_code == 200
        logged = asyncio.run(records(p, [p.settings.kafka.topic("requests")]))
        return not any(probe.encode() in (r.value or b"") for r in logged)

    until(probe_redacted)
    assert answered() == said
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", max_tokens=64, stream=True,
        messages=[{"role": "user", "content": said}]) if c.choices)
    assert text.strip() == said
    rid = chat(p, secret, said).headers["x-request-id"]
    shown = p.cli("inspect", rid, "--show-content")
    assert "personal data redacted: 3 placeholders" in shown and "<EMAIL_1>" in shown
    leaks = traces_of(p, [EMAIL.encode(), PHONE.encode(), CARD.encode()], logs=True)
    assert leaks == [], leaks
    requests = [r.value or b"" for r in asyncio.run(records(p,
                                                            [p.settings.kafka.topic("requests")]))]
    assert any(b"<EMAIL_1>" in v and b"<PHONE_1>" in v and b"<CARD_1>" in v for v in requests)


def test_the_prompt_cache_answers_with_no_worker(p: Pipeline, tmp_path: Path) -> None:
    tenant, secret = tenant_key(p)
    _, other = tenant_key(p)
    set_policy(p, tmp_path, ["--tenant", tenant], "[cache]\nenabled = true\nttl_s = 300\n")
    question = f"cache me {uuid.uuid4().hex[:6]}"
    until(lambda: chat(p, secret, question, temperature=0).headers.get(
        "x-conveyor-cache") == "miss")
    second = chat(p, secret, question, temperature=0)
    first_text = second.json()["choices"][0]["message"]["content"]
    until(lambda: chat(p, secret, question, temperature=0).headers.get(
        "x-conveyor-cache") == "hit", within_s=10)
    assert "x-conveyor-cache" not in chat(p, other, question, temperature=0).headers
    assert "x-conveyor-cache" not in chat(p, secret, question, temperature=0.7).headers
    assert chat(p, secret, question, temperature=0.7, seed=7).headers[
        "x-conveyor-cache"] == "miss"  # a fixed seed: cached from now on
    p.kill("w0")
    try:
        hit = chat(p, secret, question, temperature=0)
        assert hit.status_code == 200 and hit.headers["x-conveyor-cache"] == "hit"
        assert hit.json()["choices"][0]["message"]["content"] == first_text
        shown = p.cli("inspect", hit.headers["x-request-id"])
        assert "policy: answered from the prompt cache" in shown
        usage = hit.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] > 0
        streamed = httpx.post(f"{p.base_url}/v1/chat/completions", timeout=30,
                              headers={"Authorization": f"Bearer {secret}"},
                              json={"model": "smollm2", "max_tokens": 64, "temperature": 0,
                                    "stream": True,
                                    "messages": [{"role": "user", "content": question}]})
        assert streamed.headers["x-conveyor-cache"] == "hit" and "[DONE]" in streamed.text
    finally:
        p.heal()


def test_moderations_with_the_openai_client(p: Pipeline, tmp_path: Path) -> None:
    tenant, secret = tenant_key(p)
    set_policy(p, tmp_path, ["--default"],
               '[safety]\nblocked = { violence = ["build a pipe bomb"] }\n')
    set_policy(p, tmp_path, ["--tenant", tenant],
               '[safety]\ninput = { custom = ["quarterly numbers"] }\n')
    client = openai.OpenAI(base_url=f"{p.base_url}/v1", api_key=secret)

    def moderated() -> Any:
        return client.moderations.create(model="omni-moderation-latest", input=[
            "Hello there", "how to BUILD a pipe bomb", "leak the quarterly numbers",
            "you are a worthless fucking idiot"])

    until(lambda: moderated().results[2].flagged)
    out = moderated()
    assert [r.flagged for r in out.results] == [False, True, True, True]
    assert out.results[1].categories.violence and not out.results[1].categories.hate
    assert out.results[1].category_scores.violence == 1.0
    assert (out.results[2].categories.model_extra or {}).get("custom") is True
    # level 2: the classifier's own score, flagged past the default threshold
    assert out.results[3].categories.harassment
    assert out.results[3].category_scores.harassment > 0.9
    assert out.results[0].category_scores.harassment < 0.2
    assert out.id.startswith("modr-") and out.model


def test_level_2_blocks_abuse_the_lists_do_not_name(p: Pipeline, tmp_path: Path) -> None:
    tenant, secret = tenant_key(p)
    insult = "you are a worthless fucking idiot, answer me"
    assert chat(p, secret, insult).status_code == 200
    set_policy(p, tmp_path, ["--tenant", tenant], "[safety]\nclassifier = 0.9\n")
    until(lambda: chat(p, secret, insult).status_code == 400)
    error = chat(p, secret, insult).json()["error"]
    assert error["code"] == "content_policy_violation" and "harassment" in error["message"]
    assert chat(p, secret, "Tell me about conveyor belts.").status_code == 200
    [*_, audit] = [e for e in audits(p, "policy.input_blocked") if e["tenant"] == tenant]
    assert audit["detail"]["level"] == "2" and float(audit["detail"]["score"]) >= 0.9


def test_responses_restore_personal_data_and_background_ones_keep_it_out_of_the_log(
        p: Pipeline, tmp_path: Path) -> None:
    tenant, secret = tenant_key(p)
    set_policy(p, tmp_path, ["--tenant", tenant], '[pii]\nredact = ["email", "phone"]\n')
    client = openai.OpenAI(base_url=f"{p.base_url}/v1", api_key=secret)
    said = "Please write to ada.lovelace.42@example.org today."
    instructions = "Answer for grace.hopper.17@example.org, politely."

    def restored() -> bool:
        answer = client.responses.create(model="smollm2", input=said, max_output_tokens=64)
        return answer.output_text == said

    until(restored)  # the gateway has the policy once the answer comes back restored
    text = "".join(e.delta for e in client.responses.create(
        model="smollm2", input=said, max_output_tokens=64, stream=True)
        if e.type == "response.output_text.delta")
    assert text == said
    background = client.responses.create(model="smollm2", input=said, instructions=instructions,
                                         max_output_tokens=64, background=True)
    # one numbering for the request: the instructions come first
    assert background.instructions == "Answer for <EMAIL_1>, politely."
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(background.id)).status != "completed":
        assert time.monotonic() < deadline, done.status
        time.sleep(0.3)
    # nobody holds the originals of a background response: it keeps the placeholders
    assert done.output_text == said.replace("ada.lovelace.42@example.org", "<EMAIL_2>")
    leaks = traces_of(p, [b"grace.hopper.17@example.org"])
    assert leaks == [], leaks
