"""What preprocess reads of a request for the safety lists: every text the model
reads (level 1), and the conversation's user turns as one text (level 3)."""

from __future__ import annotations

from conveyor.policy.rules import PolicyBook
from conveyor.policy.safety import TermList
from schemas.records import Message, ToolCall
from tests.support.factories import generation
from tests.support.loop import ticks_while
from workers.policy_checks import (
    OFF_LOOP_CHARS,
    blocked_input,
    checked_input,
    input_refusal,
    redact_generation,
    redacted,
    text_size,
)

TERMS = TermList({"violence": ["build a pipe bomb"]})


def test_a_term_in_one_message_or_in_a_completion_prompt_is_found() -> None:
    chat = generation([{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "How to BUILD a  pipe bomb?"}])
    found = blocked_input(TERMS, chat)
    assert found is not None and found.category == "violence"
    prompt = generation(kind="completion", prompt="build a pipe bomb at home")
    assert blocked_input(TERMS, prompt) is not None
    assert blocked_input(TERMS, generation([{"role": "user", "content": "build a pipe"}])) \
        is None
    assert blocked_input(TermList(), chat) is None


def test_a_term_spread_over_two_user_turns_is_found_as_the_conversation() -> None:
    spread = generation([{"role": "user", "content": "how would I build a pipe"},
                         {"role": "assistant", "content": "A pipe of what?"},
                         {"role": "user", "content": "bomb, I mean"}])
    found = blocked_input(TERMS, spread)
    assert found is not None and found.category == "violence"
    # the assistant's turn is not glued to the user's: no term across roles
    across = generation([{"role": "user", "content": "build a pipe"},
                         {"role": "assistant", "content": "bomb"}])
    assert blocked_input(TERMS, across) is None


def test_a_term_in_an_earlier_tool_call_is_found() -> None:
    chat = generation([{"role": "user", "content": "plan it"},
                       {"role": "assistant", "content": "", "tool_calls": [
                           {"id": "c1", "name": "search",
                            "arguments": '{"q": "build a pipe bomb"}'}]}])
    assert blocked_input(TERMS, chat) is not None


def test_the_refusal_names_the_category_not_the_term() -> None:
    found = blocked_input(TERMS, generation([{"role": "user", "content": "build a pipe bomb"}]))
    assert found is not None
    refusal = input_refusal(found)
    assert refusal.status == 400 and refusal.code == "content_policy_violation"
    assert "violence" in refusal.message and "bomb" not in refusal.message


def _message(role: str, content: str, calls: list[ToolCall] | None = None) -> Message:
    return {"role": role, "content": content, "name": None, "tool_calls": calls,
            "tool_call_id": None}


def test_the_size_is_the_characters_the_checks_read() -> None:
    call = ToolCall(id="call_1", name="f", arguments='{"a": 1}')
    chat = generation([_message("user", "hello"), _message("assistant", "", [call])])
    assert text_size(chat) == len("hello") + len('{"a": 1}')
    assert text_size(generation(kind="completion", prompt="x" * 7)) == 7
    assert text_size(generation(kind="completion", prompt=None)) == 0


async def test_a_large_input_is_checked_while_the_loop_serves_others() -> None:
    terms = TermList({"violence": ["kill"]}, {"secrets": [r"\bsk-[a-z0-9]{20,}\b"]})
    prose = "the belt moves boxes along the line, and a worker checks each one. "
    prompt = prose * (40 * OFF_LOOP_CHARS // len(prose)) + "then kill it"
    found, ticks = await ticks_while(
        checked_input(terms, generation(kind="completion", prompt=prompt)))
    assert found is not None and found.term == "kill" and found.start == len(prompt) - 7
    assert ticks >= 2  # inline, the loop could not have run anything until the end
    small, ticks = await ticks_while(
        checked_input(terms, generation(kind="completion", prompt="kill it")))
    assert small is not None and ticks == 0


ANN = "ann@example.com"
PHONE = "+1 415 555 0134"


async def test_a_large_request_is_redacted_while_the_loop_serves_others() -> None:
    book = PolicyBook()
    book.set("tenant:acme", '[pii]\nredact = ["email", "phone"]\n')
    line = f"call {PHONE} or write {ANN}; the belt moves boxes along the line. "
    prompt = line * (20 * OFF_LOOP_CHARS // len(line))
    (out, redactor), ticks = await ticks_while(
        redacted(generation(kind="completion", prompt=prompt), book.effective("acme")))
    assert out["prompt"] == prompt.replace(PHONE, "<PHONE_1>").replace(ANN, "<EMAIL_1>")
    assert redactor.mapping == {"<PHONE_1>": PHONE, "<EMAIL_1>": ANN}
    assert ticks >= 2  # inline, the loop could not have run anything until the end
    small = generation(kind="completion", prompt=f"write to {ANN}")
    (out, _), ticks = await ticks_while(redacted(small, book.effective("acme")))
    assert out["prompt"] == "write to <EMAIL_1>"
    assert ticks == 0  # no hand-off to a thread: nothing else ran meanwhile


def test_redaction_keeps_each_image_between_the_same_words() -> None:
    book = PolicyBook()
    book.set("tenant:acme", '[pii]\nredact = ["email"]\n')
    before = "Mail ann@example.com "  # the image stood here
    image = {"file_id": "file-" + "a" * 24, "media_type": "image/png", "bytes": 1,
             "sha256": "a" * 64, "width": 1, "height": 1, "offset": len(before),
             "part": "messages[0].content[1]"}
    out, _ = redact_generation(generation([Message(
        role="user", content=before + "then bob@example.com", images=[image])]),
        book.effective("acme"))
    (message,) = out["messages"]
    assert message["content"] == "Mail <EMAIL_1> then <EMAIL_2>"
    (ref,) = message["images"] or []
    assert message["content"][:ref["offset"]] == "Mail <EMAIL_1> "
