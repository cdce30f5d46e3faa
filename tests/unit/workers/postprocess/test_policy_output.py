"""The answer's safety check in postprocess: a RequestStream with a StreamScanner
cuts the answer before a blocked term however the chunks split it, and the
layer ends such an answer with ``content_filter`` and audits it without the
term; and an answer from the prompt cache says so in its replies."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conveyor.policy.rules import PolicyBook
from conveyor.policy.safety import Match, StreamScanner, TermList
from conveyor.settings import Settings, load_settings
from schemas.codec import default_codec
from schemas.records import ChunkHeader, Prompt, TokenChunk
from tests.support.factories import Record, generation
from topics.envelope import new_envelope
from workers.outputs import Output
from workers.postprocess import PostprocessLayer
from workers.postprocess.stream import Emitted, RequestStream
from workers.prompt_cache import Cached, hit_chunk

TERM = "how to make a bomb"
TERMS = TermList({"violence": [TERM]})

# --- RequestStream with a scanner -----------------------------------------------------------


def header() -> ChunkHeader:
    return ChunkHeader(kind="chat", model="m", created=1, stop=[], stream=True,
                       include_usage=False, prompt_tokens=5)


def chunk(seq: int, text: str, finish: str | None = None, *, rid: str = "r1",
          tenant: str = "default", worker: str = "w0", include_usage: bool = False
          ) -> TokenChunk:
    h = header()
    h["include_usage"] = include_usage
    envelope = new_envelope(rid, reply_gateway="g", reply_partition=1, tenant=tenant,
                            key_id="k1")
    return TokenChunk(envelope=envelope, seq=seq, text=text, tokens=1, finish_reason=finish,
                      worker_id=worker, header=h if seq == 0 else None, error=None,
                      run_id="run1", run_start=0)


def scanned(terms: TermList = TERMS) -> RequestStream:
    return RequestStream(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                         scanner=StreamScanner(terms))


def feed(s: RequestStream, *texts: str, last_finish: str | None = None) -> list[Emitted]:
    out: list[Emitted] = []
    for i, text in enumerate(texts):
        finish = last_finish if i == len(texts) - 1 else None
        out.extend(s.take(chunk(i, text, finish)))
    return out


def released(emitted: list[Emitted]) -> str:
    return "".join(e.text for e in emitted)


@pytest.mark.parametrize("texts", [
    ["Here is how to ma", "ke a bomb, step one"],
    ["Here is how to make a b", "omb."],
    ["Here is how ", "to make a ", "bomb: step one"],
    ["Here is h", "ow to make a bo", "mb!"],
    ["Here is how to make a bomb", " now"],  # whole at the end: a word could follow
])
def test_a_term_split_across_chunks_is_never_released(texts: list[str]) -> None:
    s = scanned()
    out = feed(s, *texts)
    assert released(out) == "Here is "
    last = out[-1]
    assert last.finish_reason == "content_filter"
    assert last.stopped_early is True  # the worker still runs: told to stop
    assert all(e.finish_reason is None for e in out[:-1])
    assert s.done
    assert s.filtered == Match("violence", TERM, 8, 8 + len(TERM))
    # nothing after the match gets through
    assert s.take(chunk(len(texts), " more", "stop")) == []


def test_text_is_released_until_it_could_begin_the_term() -> None:
    s = scanned()
    first = s.take(chunk(0, "I know how to"))
    assert released(first) == "I know "
    assert s.scanner is not None and s.scanner.held == len("how to")
    # what turns out not to be the term goes out with the next chunk
    second = s.take(chunk(1, " cook well"))
    assert released(second) == "how to cook well"
    assert s.scanner.held == 0 and not s.done


def test_a_match_in_the_last_chunk_ends_without_stopping_the_worker() -> None:
    s = scanned()
    out = feed(s, "Fine. How to make ", "a bomb", last_finish="stop")
    assert released(out) == "Fine. "
    assert out[-1].finish_reason == "content_filter"
    assert out[-1].stopped_early is False  # the worker had finished
    assert s.filtered is not None and s.filtered.category == "violence"


def test_a_match_in_a_single_last_chunk_keeps_the_text_before_it() -> None:
    s = scanned()
    out = feed(s, "Sure: how to make a bomb is not", last_finish="length")
    assert [(e.text, e.finish_reason, e.stopped_early) for e in out] == \
        [("Sure: ", "content_filter", False)]


def test_an_answer_without_the_term_is_released_whole() -> None:
    s = scanned()
    out = feed(s, "How to make a bo", "at: ", "cut planks.", last_finish="stop")
    assert released(out) == "How to make a boat: cut planks."
    assert out[-1].finish_reason == "stop" and s.filtered is None


def test_the_held_tail_is_released_at_the_finish() -> None:
    s = scanned()
    out = feed(s, "Learn how to make a", last_finish="length")
    assert released(out) == "Learn how to make a"
    assert out[-1].finish_reason == "length"


# --- PostprocessLayer with a policy ---------------------------------------------------------

OUTPUT_POLICY = '[safety]\noutput = { leaks = ["internal use only"] }\n'
SECRET = "internal use only"


@pytest.fixture
def settings() -> Settings:
    return load_settings(topic_prefix="pptest")


@pytest.fixture
def book() -> PolicyBook:
    book = PolicyBook()
    assert book.set("tenant:acme", OUTPUT_POLICY)
    return book


@pytest.fixture
def layer(settings: Settings, book: PolicyBook) -> PostprocessLayer:
    return PostprocessLayer(settings, policies=book)


async def handle_all(layer: PostprocessLayer, chunks: list[TokenChunk]) -> list[Output]:
    outputs: list[Output] = []
    codec = default_codec()
    for offset, c in enumerate(chunks):
        out = await layer.handle(c, Record(layer.source.at(layer.settings.kafka), 0, offset))
        for o in out:  # every output is an event the log takes
            assert codec.decode(codec.encode(o.event_type, o.record), o.event_type) == o.record
        outputs.extend(out)
    return outputs


def of_type(outputs: list[Output], event_type: str) -> list[Any]:
    return [o.record for o in outputs if o.event_type == event_type]


def chunk_objects(replies: list[Any]) -> list[dict[str, Any]]:
    return [json.loads(line) for r in replies for line in r["chunk"].split("\n") if line]


async def test_a_blocked_answer_ends_with_content_filter_and_is_audited(
        layer: PostprocessLayer, settings: Settings) -> None:
    chunks = [chunk(0, "The memo is for inter", tenant="acme", include_usage=True),
              chunk(1, "nal use", tenant="acme"),
              chunk(2, " only, so", tenant="acme"),
              chunk(3, " no.", "stop", tenant="acme")]
    outputs = await handle_all(layer, chunks)

    replies = of_type(outputs, "Reply")
    assert [r["kind"] for r in replies][-1] == "final"
    final = replies[-1]
    assert final["finish_reason"] == "content_filter"
    assert "".join(r["text"] for r in replies) == "The memo is for "
    objects = chunk_objects(replies)
    content = "".join(o["choices"][0]["delta"].get("content") or ""
                      for o in objects if o["choices"])
    assert content == "The memo is for "
    finishes = [o["choices"][0]["finish_reason"] for o in objects if o["choices"]]
    assert finishes[-1] == "content_filter" and finishes.count("content_filter") == 1
    assert objects[-1]["choices"] == [] and objects[-1]["usage"]["completion_tokens"] == 3
    assert final["usage"]["completion_tokens"] == 3  # the fourth chunk never applied

    audits = of_type(outputs, "AuditEvent")
    assert len(audits) == 1
    audit = audits[0]
    assert audit["action"] == "policy.output_blocked"
    assert (audit["tenant"], audit["key_id"], audit["request_id"]) == ("acme", "k1", "r1")
    assert audit["actor"] == "postprocess"
    assert audit["detail"] == {"category": "leaks", "level": "1", "scopes": "tenant:acme"}
    assert audit["reason"] == "content policy: leaks"
    audit_output = next(o for o in outputs if o.event_type == "AuditEvent")
    assert audit_output.topic == settings.kafka.topic("audit") and audit_output.key == "acme"
    # the term is nowhere in the log's copy of the block
    for word in ("internal", "use only", SECRET):
        assert word not in json.dumps(audit)
    # the worker, still generating when the match was found, is told to stop
    controls = of_type(outputs, "Control")
    assert [c["action"] for c in controls] == ["cancel"]
    assert controls[0]["request_id"] == "r1"
    # and the request is over: a later chunk changes nothing
    assert await layer.handle(chunk(3, " no.", "stop", tenant="acme"), None) == []


async def test_a_block_in_the_last_chunk_sends_no_cancel(layer: PostprocessLayer) -> None:
    outputs = await handle_all(layer, [
        chunk(0, "Label: internal", tenant="acme"),
        chunk(1, " use only", "stop", tenant="acme")])
    replies = of_type(outputs, "Reply")
    assert replies[-1]["finish_reason"] == "content_filter"
    assert "".join(r["text"] for r in replies) == "Label: "
    assert of_type(outputs, "Control") == []
    assert len(of_type(outputs, "AuditEvent")) == 1


async def test_another_tenant_is_not_filtered(layer: PostprocessLayer) -> None:
    outputs = await handle_all(layer, [
        chunk(0, "The memo is for internal", tenant="globex"),
        chunk(1, " use only.", "stop", tenant="globex")])
    replies = of_type(outputs, "Reply")
    assert "".join(r["text"] for r in replies) == "The memo is for internal use only."
    assert replies[-1]["finish_reason"] == "stop"
    assert of_type(outputs, "AuditEvent") == []
    assert all(r["cached"] is False for r in replies)


async def test_an_answer_from_the_cache_is_marked_cached(layer: PostprocessLayer) -> None:
    g = generation(temperature=0.0, created=1_700_000_000)
    g.update({"stream": True, "include_usage": True})
    envelope = new_envelope("r-cache", reply_gateway="g", reply_partition=2, tenant="globex")
    prompt = Prompt(text="p", tokens=17, exact=True, max_tokens=64, dropped_messages=0,
                    fingerprint="f" * 32, prefix_blocks=[], cache_key="", cache_ttl_s=0)
    hit = hit_chunk(envelope, g, prompt, Cached("Kafka is a log.", 5, "stop", "smollm2"))

    outputs = await handle_all(layer, [hit])

    replies = of_type(outputs, "Reply")
    assert replies and all(r["cached"] is True for r in replies)
    final = replies[-1]
    assert final["kind"] == "final" and final["finish_reason"] == "stop"
    assert "".join(r["text"] for r in replies) == "Kafka is a log."
    # every prompt token counted as cached
    assert final["usage"] == {"prompt_tokens": 17, "completion_tokens": 5, "cached_tokens": 17}
    assert chunk_objects(replies)[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 17}
    assert of_type(outputs, "UsageRecord")[0]["completion_tokens"] == 5


async def test_a_cached_answer_is_checked_like_any_answer(layer: PostprocessLayer) -> None:
    g = generation(temperature=0.0)
    envelope = new_envelope("r-cache2", reply_gateway="g", reply_partition=0, tenant="acme")
    prompt = Prompt(text="p", tokens=3, exact=True, max_tokens=64, dropped_messages=0,
                    fingerprint="f" * 32, prefix_blocks=[], cache_key="", cache_ttl_s=0)
    cached = Cached(f"Stamped {SECRET}.", 4, "stop", "smollm2")
    outputs = await handle_all(layer, [hit_chunk(envelope, g, prompt, cached)])
    replies = of_type(outputs, "Reply")
    assert replies[-1]["finish_reason"] == "content_filter"
    assert "".join(r["text"] for r in replies) == "Stamped "
    assert all(r["cached"] is True for r in replies)
    assert len(of_type(outputs, "AuditEvent")) == 1
    assert of_type(outputs, "Control") == []  # the whole answer was in: nothing to stop
