"""Level 2: the packaged classifier scores abusive text high and plain text
low, and a policy's threshold is the strictest of its scopes."""

from __future__ import annotations

import pytest

from conveyor.errors import ConveyorError
from conveyor.policy.classifier import classifier
from conveyor.policy.rules import PolicyBook, parse_policy
from tests.support.factories import generation
from workers.policy_checks import CLASSIFIED, classified_input

INSULT = "you are a worthless fucking idiot"


def test_the_classifier_scores_abuse_high_and_plain_text_low() -> None:
    plain, insult, question = classifier().scores(
        ["Write one short sentence about conveyor belts.", INSULT,
         "What is the capital of France?"])
    assert insult > 0.9 and plain < 0.2 and question < 0.2
    assert classifier() is classifier()  # loaded once a process


def test_the_threshold_is_checked_and_the_strictest_scope_wins() -> None:
    assert parse_policy("[safety]\nclassifier = 0.75\n").classifier == 0.75
    for bad in ("0", "1.5", "true", '"high"'):
        with pytest.raises(ConveyorError, match="safety.classifier"):
            parse_policy(f"[safety]\nclassifier = {bad}\n")
    book = PolicyBook()
    book.set("default", "[safety]\nclassifier = 0.9\n")
    book.set("tenant:acme", "[safety]\nclassifier = 0.95\n")  # cannot loosen it
    book.set("tenant:strict", "[safety]\nclassifier = 0.5\n")
    assert book.effective("acme").classifier == 0.9
    assert book.effective("strict").classifier == 0.5
    assert PolicyBook().effective("anyone").classifier is None


async def test_classified_input_reads_the_user_turns() -> None:
    abusive = generation([{"role": "system", "content": "Be kind."},
                          {"role": "user", "content": INSULT}])
    found = await classified_input(0.9, abusive)
    assert found is not None and found.category == "harassment"
    assert found.term.startswith(CLASSIFIED)
    assert await classified_input(0.9, generation([
        {"role": "user", "content": "Tell me about conveyor belts."}])) is None
    # the system prompt is the operator's, not what the user wrote
    assert await classified_input(0.9, generation([
        {"role": "system", "content": INSULT},
        {"role": "user", "content": "Hello"}])) is None
    assert await classified_input(0.9, generation(kind="completion", prompt=INSULT))
