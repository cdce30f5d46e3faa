"""What preprocess reads of a request for the safety lists: every text the model
reads (level 1), and the conversation's user turns as one text (level 3)."""

from __future__ import annotations

from conveyor.policy.safety import TermList
from tests.support.factories import generation
from workers.policy_checks import blocked_input, input_refusal

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
