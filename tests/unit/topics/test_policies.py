"""A policy document read from conveyor.policies that does not parse (written by
hand, or by another version) is passed over: the scope keeps what it had."""

from __future__ import annotations

from conveyor.policy.rules import PolicyBook
from topics.policies import _adopt, document_of


def test_a_bad_document_on_the_topic_leaves_the_scope_as_it_was() -> None:
    book = PolicyBook()
    _adopt(book, document_of("tenant:acme", '[safety]\nblocked = { x = ["bad word"] }\n', "f"))
    bad = {**document_of("tenant:acme", "", "f"), "text": "[safety]\nblocked = 3\n"}
    _adopt(book, bad)  # type: ignore[arg-type]
    assert book.effective("acme").input_terms.first("a bad word") is not None
    _adopt(book, document_of("tenant:acme", "", "f"))  # cleared
    assert book.effective("acme").input_terms.empty
