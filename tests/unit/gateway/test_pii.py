"""Personal data at the gateway: a request's texts redacted (redact_generation) and
the originals put back into the replies of its answer (ReplyRestorer), split
placeholders included."""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

import pytest

from conveyor.policy.rules import Policy, PolicyBook
from gateway.pii import ReplyRestorer
from schemas.openai.chunks import delta_chunk, tool_call_chunk, usage_chunk
from schemas.records import ChunkHeader, Message, Reply, ToolCall, Usage
from tests.support.factories import generation
from topics.envelope import new_envelope
from workers.policy_checks import redact_generation

ANN = "ann@example.com"
BOB = "bob@example.org"
IP = "10.1.2.3"
MAPPING = {"<EMAIL_1>": ANN, "<EMAIL_2>": BOB}
RID = "r1"


def policy(redact: str = '["email", "ip"]') -> Policy:
    book = PolicyBook()
    book.set("tenant:acme", f"[pii]\nredact = {redact}\n")
    return book.effective("acme")


def message(role: str, content: str, calls: list[ToolCall] | None = None) -> Message:
    return {"role": role, "content": content, "name": None, "tool_calls": calls,
            "tool_call_id": None}


# --- redact_generation ---------------------------------------------------------------------


def test_a_chat_is_redacted_in_contents_and_tool_call_arguments() -> None:
    call = ToolCall(id="call_1", name="send_mail",
                    arguments=json.dumps({"to": ANN, "cc": BOB}))
    chat = generation([
        message("system", "You send mail."),
        message("user", f"Write to {ANN} and {BOB} from {IP}."),
        message("assistant", "", [call]),
        message("tool", "sent"),
        message("user", f"Again to {ANN}, please."),
    ])
    original = copy.deepcopy(chat)

    redacted, redactor = redact_generation(chat, policy())

    messages = redacted["messages"]
    assert messages[0]["content"] == "You send mail."
    assert messages[1]["content"] == "Write to <EMAIL_1> and <EMAIL_2> from <IP_1>."
    calls = messages[2]["tool_calls"]
    assert calls is not None
    assert json.loads(calls[0]["arguments"]) == {"to": "<EMAIL_1>", "cc": "<EMAIL_2>"}
    assert (calls[0]["id"], calls[0]["name"]) == ("call_1", "send_mail")
    assert messages[3]["content"] == "sent" and messages[3]["tool_calls"] is None
    # the same value, the same placeholder, in every message
    assert messages[4]["content"] == "Again to <EMAIL_1>, please."
    assert redactor.mapping == {"<EMAIL_1>": ANN, "<EMAIL_2>": BOB, "<IP_1>": IP}
    assert redactor.counts == {"email": 2, "ip": 1}
    # nothing else of the request changes, and the caller's copy is left as it was
    assert {k: v for k, v in redacted.items() if k != "messages"} == \
        {k: v for k, v in original.items() if k != "messages"}
    assert chat == original
    assert ANN not in json.dumps(redacted) and IP not in json.dumps(redacted)


def test_only_what_the_policy_names_is_redacted() -> None:
    chat = generation([message("user", f"{ANN} at {IP}")])
    redacted, redactor = redact_generation(chat, policy('["ip"]'))
    assert redacted["messages"][0]["content"] == f"{ANN} at <IP_1>"
    assert redactor.mapping == {"<IP_1>": IP}

    untouched, nothing = redact_generation(chat, policy("[]"))
    assert untouched["messages"][0]["content"] == f"{ANN} at {IP}"
    assert nothing.mapping == {}


def test_a_completion_prompt_is_redacted() -> None:
    completion = generation(kind="completion",
                            prompt=f"From {ANN} ({IP}) to {BOB}; reply to {ANN}:")
    redacted, redactor = redact_generation(completion, policy())
    assert redacted["prompt"] == "From <EMAIL_1> (<IP_1>) to <EMAIL_2>; reply to <EMAIL_1>:"
    assert redacted["messages"] == []
    assert redactor.mapping == {"<EMAIL_1>": ANN, "<IP_1>": IP, "<EMAIL_2>": BOB}
    assert completion["prompt"] == f"From {ANN} ({IP}) to {BOB}; reply to {ANN}:"


# --- ReplyRestorer -------------------------------------------------------------------------


def header(kind: Literal["chat", "completion"] = "chat", include_usage: bool = True
           ) -> ChunkHeader:
    return ChunkHeader(kind=kind, model="smollm2", created=1_700_000_000, stop=[],
                       stream=True, include_usage=include_usage, prompt_tokens=7)


USAGE = Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=0)


def reply(index: int, text: str, lines: list[str], final: bool = False) -> Reply:
    return Reply(envelope=new_envelope(RID, reply_gateway="g", reply_partition=0),
                 index=index, kind="final" if final else "delta", text=text,
                 chunk="\n".join(lines), finish_reason="stop" if final else None,
                 usage=USAGE if final else None, error=None, logprobs=[], cached=False)


def chat_replies(pieces: list[str]) -> list[Reply]:
    """An answer as postprocess writes it: a role chunk first, one content
    chunk per piece, the last piece with the finish and the usage chunks."""
    h = header()
    out: list[Reply] = []
    for i, piece in enumerate(pieces):
        lines = [delta_chunk(h, RID, "", role=True)] if i == 0 else []
        if piece:
            lines.append(delta_chunk(h, RID, piece))
        last = i == len(pieces) - 1
        if last:
            lines += [delta_chunk(h, RID, "", "stop"), usage_chunk(h, RID, USAGE)]
        out.append(reply(i, piece, lines, final=last))
    return out


def objects(r: Reply) -> list[dict[str, Any]]:
    return [json.loads(line) for line in r["chunk"].split("\n")] if r["chunk"] else []


def contents(r: Reply) -> str:
    """The chat content the reply's chunks carry."""
    return "".join(o["choices"][0]["delta"].get("content") or ""
                   for o in objects(r) if o["choices"])


def restored(replies: list[Reply], mapping: dict[str, str] | None = None) -> list[Reply]:
    restorer = ReplyRestorer(MAPPING if mapping is None else mapping)
    return [restorer.apply(r) for r in replies]


@pytest.mark.parametrize("pieces", [
    ["Write to <EMA", "IL_1> today", "."],
    ["Write to <", "EMAIL_1", "> today."],
    ["Write to <EMAIL_1", "> today", "."],
])
def test_a_placeholder_split_across_replies_is_restored_whole(pieces: list[str]) -> None:
    original = chat_replies(pieces)
    out = restored(original)
    expected = f"Write to {ANN} today."
    assert "".join(r["text"] for r in out) == expected
    assert "".join(contents(r) for r in out) == expected
    # the text and the chunks agree reply by reply, and a placeholder is never cut
    for r in out:
        assert r["text"] == contents(r)
        assert "<" not in r["text"] and "<" not in r["chunk"]
    # the held part shows up as soon as it is whole: in the reply that completes it
    complete = next(i for i, p in enumerate(pieces) if ">" in p)
    assert ANN in out[complete]["text"] and ANN in contents(out[complete])
    # and everything else of the reply is kept
    for before, after in zip(original, out, strict=True):
        assert {k: v for k, v in after.items() if k not in ("text", "chunk")} == \
            {k: v for k, v in before.items() if k not in ("text", "chunk")}


def test_two_placeholders_and_one_whole_in_a_reply() -> None:
    out = restored(chat_replies(["<EMAIL_2> wrote to <EMAIL_1> and <EM", "AIL_2>."]))
    assert [r["text"] for r in out] == [f"{BOB} wrote to {ANN} and ", f"{BOB}."]
    assert [contents(r) for r in out] == [r["text"] for r in out]


def test_the_held_rest_is_flushed_into_the_final_reply() -> None:
    # "<EMAIL_" could still become a placeholder: held, then sent as it is at the end
    pieces = ["Ask <EMAIL_", ""]
    original = chat_replies(pieces)
    out = restored(original)
    assert out[0]["text"] == "Ask " and contents(out[0]) == "Ask "
    assert out[1]["text"] == "<EMAIL_" and contents(out[1]) == "<EMAIL_"
    final = objects(out[1])
    # the rest goes into the last chunk with choices (the finish chunk), not the usage chunk
    assert len(final) == 2
    assert final[0]["choices"][0] == {"index": 0, "delta": {"content": "<EMAIL_"},
                                      "logprobs": None, "finish_reason": "stop"}
    assert final[1]["choices"] == [] and final[1]["usage"]["completion_tokens"] == 5
    assert out[1]["chunk"].split("\n")[1] == original[1]["chunk"].split("\n")[1]


def test_a_placeholder_not_in_the_mapping_is_left_alone() -> None:
    out = restored(chat_replies(["<EMAIL_3> and <PHONE_1> and <EMAIL_1>", "."]))
    assert "".join(r["text"] for r in out) == f"<EMAIL_3> and <PHONE_1> and {ANN}."
    assert "".join(contents(r) for r in out) == f"<EMAIL_3> and <PHONE_1> and {ANN}."


def test_a_completion_chunk_is_restored_in_its_text() -> None:
    h = header("completion", include_usage=False)
    replies = [
        reply(0, "Mail <EMAIL", [delta_chunk(h, RID, "Mail <EMAIL")]),
        reply(1, "_1> now", [delta_chunk(h, RID, "_1> now")]),
        reply(2, "", [delta_chunk(h, RID, "", "stop")], final=True),
    ]
    out = restored(replies)
    texts = ["".join(o["choices"][0]["text"] for o in objects(r)) for r in out]
    assert texts == ["Mail ", f"{ANN} now", ""]
    assert [r["text"] for r in out] == texts
    for r in out:
        for o in objects(r):
            assert "delta" not in o["choices"][0] and o["object"] == "text_completion"


def test_tool_call_arguments_are_restored_per_call() -> None:
    h = header(include_usage=False)
    raw = [
        [delta_chunk(h, RID, "", role=True),
         tool_call_chunk(h, RID, 0, "", "call_a", "send_mail"),
         tool_call_chunk(h, RID, 0, '{"to": "<EMA')],
        [tool_call_chunk(h, RID, 1, "", "call_b", "send_mail"),
         tool_call_chunk(h, RID, 1, '{"to": "<EMAIL_2>"}'),
         tool_call_chunk(h, RID, 0, 'IL_1>"}')],
        [delta_chunk(h, RID, "", "tool_calls")],
    ]
    replies = [reply(i, "", lines, final=i == len(raw) - 1) for i, lines in enumerate(raw)]
    out = restored(replies)

    arguments: dict[int, str] = {}
    names: dict[int, str] = {}
    for r in out:
        for o in objects(r):
            for call in o["choices"][0]["delta"].get("tool_calls") or ():
                arguments[call["index"]] = arguments.get(call["index"], "") + \
                    call["function"]["arguments"]
                if "id" in call:
                    names[call["index"]] = call["function"]["name"]
    assert json.loads(arguments[0]) == {"to": ANN}
    assert json.loads(arguments[1]) == {"to": BOB}
    assert names == {0: "send_mail", 1: "send_mail"}
    # the split one: nothing of the placeholder went out before it was whole
    first_args = [c["function"]["arguments"] for o in objects(out[0])
                  for c in o["choices"][0]["delta"].get("tool_calls") or ()]
    assert first_args == ["", '{"to": "']


def test_lines_without_placeholders_pass_byte_identical() -> None:
    h = header()
    odd = '{"id": "x",  "choices": [ ], "note": "not re-encoded \\u00e9"}'
    lines = [delta_chunk(h, RID, "", role=True), delta_chunk(h, RID, "Héllo, wörld"), odd]
    original = reply(0, "Héllo, wörld", lines)
    out = ReplyRestorer(MAPPING).apply(original)
    assert out["chunk"] == original["chunk"]
    assert out["text"] == original["text"]

    final = reply(1, "Bye", [delta_chunk(h, RID, "Bye"), delta_chunk(h, RID, "", "stop"),
                             usage_chunk(h, RID, USAGE)], final=True)
    assert ReplyRestorer(MAPPING).apply(final)["chunk"] == final["chunk"]


def test_a_restorer_without_mapping_changes_nothing() -> None:
    replies = chat_replies(["Keep <EMAIL_1> as", " it is."])
    out = restored(replies, mapping={})
    assert [r["text"] for r in out] == [r["text"] for r in replies]
    assert [r["chunk"] for r in out] == [r["chunk"] for r in replies]
