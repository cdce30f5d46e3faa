"""Personal data redacted (what is found: test_recognisers.py): a request's redactor
numbers placeholders per entity and reuses them; a restore puts back exactly the
originals and nothing where the user typed a placeholder; a streamed restore equals the
whole one however the answer is chunked, holding back less than one placeholder."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.policy.pii import FindMemo, Redactor
from conveyor.policy.recognisers import ENTITIES, find_checked
from conveyor.policy.restore import Restorer

# --- the memo of texts seen lately ---------------------------------------------------------

_TEXT = "Write to jane.doe@example.com or call +1 415 555 0134 before Friday."


def test_a_repeated_text_is_found_from_the_memo_as_it_was_searched() -> None:
    memo = FindMemo()
    first = memo.find(_TEXT, ENTITIES, "US")
    again = memo.find(_TEXT, ENTITIES, "US")
    assert first == again == find_checked(_TEXT, ENTITIES, "US")
    assert [f.entity for f in again] == ["email", "phone"]
    assert (memo.hits, memo.misses) == (1, 1)


def test_the_memo_keys_entities_and_region_and_holds_no_text() -> None:
    memo = FindMemo()
    memo.find(_TEXT, ENTITIES, "US")
    assert [f.entity for f in memo.find(_TEXT, ("email",), "US")] == ["email"]
    memo.find(_TEXT, ENTITIES, "GB")
    assert (memo.hits, memo.misses, len(memo)) == (0, 3, 3)
    held = repr(memo._spans)
    assert "jane" not in held and "415" not in held


def test_the_memo_is_bounded_and_forgets_the_least_recently_found() -> None:
    memo = FindMemo(size=2)
    texts = [f"{_TEXT} Reference number {i}." for i in range(3)]
    memo.find(texts[0], ENTITIES, "US")
    memo.find(texts[1], ENTITIES, "US")
    memo.find(texts[0], ENTITIES, "US")  # texts[1] is now the oldest
    memo.find(texts[2], ENTITIES, "US")
    assert len(memo) == 2
    memo.find(texts[0], ENTITIES, "US")
    memo.find(texts[1], ENTITIES, "US")
    assert (memo.hits, memo.misses) == (2, 4)


def test_short_texts_and_a_zero_size_memo_are_searched_every_time() -> None:
    memo, off = FindMemo(min_chars=24), FindMemo(size=0)
    for _ in range(2):
        assert [f.entity for f in memo.find("a@example.com", ENTITIES, "US")] == ["email"]
        off.find(_TEXT, ENTITIES, "US")
    assert len(memo) == len(off) == 0 and memo.hits == off.hits == 0


def test_redactors_sharing_a_memo_mint_their_own_placeholders() -> None:
    memo = FindMemo()
    one, two = Redactor(memo=memo), Redactor(memo=memo)
    assert one.redact("Cc b@example.com please, it matters.") == "Cc <EMAIL_1> please, it matters."
    assert one.redact(_TEXT) == "Write to <EMAIL_2> or call <PHONE_1> before Friday."
    assert two.redact(_TEXT) == "Write to <EMAIL_1> or call <PHONE_1> before Friday."
    assert one.mapping["<EMAIL_2>"] == two.mapping["<EMAIL_1>"] == "jane.doe@example.com"
    assert (memo.hits, memo.misses) == (1, 2)


# --- redaction ---------------------------------------------------------------------------


def test_placeholders_are_numbered_per_entity_and_reused_across_messages() -> None:
    redactor = Redactor()
    first = redactor.redact("I am a@example.com, call +44 20 7946 0958 from 10.0.0.1.")
    second = redactor.redact("Cc b@example.com and a@example.com; card 4111 1111 1111 1111.")
    assert first == "I am <EMAIL_1>, call <PHONE_1> from <IP_1>."
    assert second == "Cc <EMAIL_2> and <EMAIL_1>; card <CARD_1>."
    assert redactor.mapping == {
        "<EMAIL_1>": "a@example.com",
        "<PHONE_1>": "+44 20 7946 0958",
        "<IP_1>": "10.0.0.1",
        "<EMAIL_2>": "b@example.com",
        "<CARD_1>": "4111 1111 1111 1111",
    }
    assert redactor.counts == {"email": 2, "phone": 1, "card": 1, "iban": 0, "ip": 1}


def test_values_are_compared_as_written() -> None:
    redactor = Redactor(["phone"])
    assert redactor.redact("(202) 555-0143 / 202-555-0143 / (202) 555-0143") == (
        "<PHONE_1> / <PHONE_2> / <PHONE_1>")


def test_mapping_and_counts_are_copies() -> None:
    redactor = Redactor(["email"])
    redactor.redact("a@example.com")
    redactor.mapping["<EMAIL_1>"] = "evil@example.com"
    redactor.counts["email"] = 9
    assert redactor.mapping == {"<EMAIL_1>": "a@example.com"}
    assert redactor.counts == {"email": 1}


def test_only_the_chosen_entities_are_redacted() -> None:
    redactor = Redactor(["email"])
    text = "a@example.com from 10.0.0.1"
    assert redactor.redact(text) == "<EMAIL_1> from 10.0.0.1"
    assert redactor.redact("nothing here") == "nothing here"


@pytest.mark.parametrize(
    "text",
    [
        "I am a@example.com, call +44 20 7946 0958 from 10.0.0.1.",
        "IBAN DE89 3704 0044 0532 0130 00, card 4111-1111-1111-1111, ip 2001:db8::1",
        "a@example.com a@example.com b@example.com <EMAIL_1> <IP_3>",
        "no personal data at all",
        "",
    ],
)
def test_restore_round_trips(text: str) -> None:
    redactor = Redactor()
    redacted = redactor.redact(text)
    assert not find_checked(redacted, ENTITIES, "US")
    assert Restorer(redactor.mapping).restore(redacted) == text


def test_a_typed_placeholder_not_in_the_mapping_survives_and_is_skipped() -> None:
    redactor = Redactor()
    redacted = redactor.redact("My <EMAIL_7> and <EMAIL_1> are a@example.com.")
    assert redacted == "My <EMAIL_7> and <EMAIL_1> are <EMAIL_2>."
    assert redactor.mapping == {"<EMAIL_2>": "a@example.com"}
    answer = "You wrote <EMAIL_7>, <EMAIL_1> and <EMAIL_2>."
    assert Restorer(redactor.mapping).restore(answer) == (
        "You wrote <EMAIL_7>, <EMAIL_1> and a@example.com.")
    # Numbers typed in an earlier message stay skipped.
    assert redactor.redact("b@example.com c@example.com") == "<EMAIL_3> <EMAIL_4>"
    assert redactor.redact("still <EMAIL_7>") == "still <EMAIL_7>"
    assert redactor.redact("then d@example.com") == "then <EMAIL_5>"
    assert redactor.redact("and e@example.com") == "and <EMAIL_6>"
    assert redactor.redact("and f@example.com") == "and <EMAIL_8>"


def test_a_typed_placeholder_that_is_already_minted_is_replaced_like_a_value() -> None:
    redactor = Redactor()
    assert redactor.redact("I am a@example.com") == "I am <EMAIL_1>"
    second = redactor.redact("Literally type <EMAIL_1> please, and <EMAIL_1> again")
    assert second == "Literally type <EMAIL_2> please, and <EMAIL_2> again"
    assert redactor.mapping == {"<EMAIL_1>": "a@example.com", "<EMAIL_2>": "<EMAIL_1>"}
    assert redactor.counts["email"] == 1
    restorer = Restorer(redactor.mapping)
    # Restored once: the literal comes back as typed, not as the address.
    assert restorer.restore("<EMAIL_1> typed <EMAIL_2>") == "a@example.com typed <EMAIL_1>"


def test_values_inside_a_typed_placeholder_are_left_alone() -> None:
    redactor = Redactor()
    text = "see <CARD_4111111111111111> and <PHONE_2025550143>"
    assert redactor.redact(text) == text
    assert redactor.redact("now 4111 1111 1111 1111") == "now <CARD_1>"


PIECES = ["a@example.com", "b@example.org", "+44 20 7946 0958", "(202) 555-0143",
          "4111 1111 1111 1111", "DE89 3704 0044 0532 0130 00", "10.0.0.1", "2001:db8::1",
          "<EMAIL_1>", "<EMAIL_2>", "<PHONE_1>", "<IP_3>", "<EMA", "IL_1>", "<", ">", "_",
          " ", ", ", "word", "1", "."]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.sampled_from(PIECES), max_size=12), min_size=1, max_size=3))
def test_any_messages_round_trip_and_typed_placeholders_never_get_a_value(
    messages: list[list[str]],
) -> None:
    redactor = Redactor()
    texts = ["".join(pieces) for pieces in messages]
    redacted = [redactor.redact(text) for text in texts]
    restorer = Restorer(redactor.mapping)
    # A minted placeholder left where the user typed it would be restored to its value,
    # so the exact round trip shows every one stands only where the redactor put it.
    for text, out in zip(texts, redacted, strict=True):
        assert restorer.restore(out) == text


def test_only_exact_placeholders_are_restored() -> None:
    restorer = Restorer({"<EMAIL_1>": "a@example.com"})
    altered = "<Email_1> <EMAIL 1> EMAIL_1 <EMAIL_1 > <EMAIL_10> <<EMAIL_1>>"
    assert restorer.restore(altered) == (
        "<Email_1> <EMAIL 1> EMAIL_1 <EMAIL_1 > <EMAIL_10> <a@example.com>")


# --- streaming ---------------------------------------------------------------------------

MAPPING = {"<EMAIL_1>": "a@example.com", "<PHONE_12>": "+44 20 7946 0958", "<IP_1>": "::1"}
ANSWER = "Mail <EMAIL_1> or ring <PHONE_12>; not <EMAIL_2>, <PHONE_1> or <IP_1"


def _stream(restorer: Restorer, chunks: list[str]) -> str:
    longest = max(map(len, MAPPING), default=1)
    out = []
    for chunk in chunks:
        out.append(restorer.feed(chunk))
        assert restorer.held <= max(longest - 1, 0)
    out.append(restorer.flush())
    assert restorer.held == 0
    return "".join(out)


def test_every_split_point_streams_like_a_whole_restore() -> None:
    whole = Restorer(MAPPING).restore(ANSWER)
    assert whole == ("Mail a@example.com or ring +44 20 7946 0958; "
                     "not <EMAIL_2>, <PHONE_1> or <IP_1")
    for i in range(len(ANSWER) + 1):
        assert _stream(Restorer(MAPPING), [ANSWER[:i], ANSWER[i:]]) == whole, i
        for j in range(i, len(ANSWER) + 1, 7):
            chunks = [ANSWER[:i], ANSWER[i:j], ANSWER[j:]]
            assert _stream(Restorer(MAPPING), chunks) == whole, (i, j)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(ANSWER)), max_size=12))
def test_any_chunking_streams_like_a_whole_restore(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(ANSWER)]
    chunks = [ANSWER[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _stream(Restorer(MAPPING), chunks) == Restorer(MAPPING).restore(ANSWER)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text("ab<>", min_size=1, max_size=4), st.text("xyz", max_size=3),
                    max_size=4),
    st.text("ab<>x", max_size=30),
    st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_streaming_equals_restore_for_any_keys(
    mapping: dict[str, str], text: str, cuts: list[int]
) -> None:
    # Keys that are prefixes or overlaps of each other: the hold-back still never changes
    # which placeholders a whole restore would replace.
    restorer = Restorer(mapping)
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    out = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        out.append(restorer.feed(text[a:b]))
        assert restorer.held <= max(max(map(len, mapping), default=0) - 1, 0)
    out.append(restorer.flush())
    assert "".join(out) == Restorer(mapping).restore(text)


def test_a_split_placeholder_is_held_then_restored_whole() -> None:
    restorer = Restorer(MAPPING)
    assert restorer.feed("Hi <EMA") == "Hi "
    assert restorer.held == len("<EMA")
    assert restorer.feed("IL_1") == ""
    assert restorer.held == len("<EMAIL_1")
    assert restorer.feed("> bye <") == "a@example.com bye "
    assert restorer.held == 1
    assert restorer.feed("b>") == "<b>"
    assert restorer.feed("end <EM") == "end "
    assert restorer.flush() == "<EM"
    assert restorer.flush() == ""


def test_idle_means_feeding_the_text_gives_it_back_as_it_is() -> None:
    restorer = Restorer(MAPPING)
    assert restorer.idle_for("no placeholder here") and restorer.idle_for("")
    assert not restorer.idle_for("a <b> tag")  # "<" may begin one
    restorer.feed("Hi <EMA")
    assert not restorer.idle_for("plain")  # the held tail may end in it
    restorer.feed("IL_1> done")
    assert restorer.idle_for("plain") and restorer.feed("plain") == "plain"
    assert Restorer({}).idle_for("<EMAIL_1>")


def test_the_hold_back_is_bounded_by_the_longest_placeholder() -> None:
    restorer = Restorer(MAPPING)
    longest = max(map(len, MAPPING))
    for ch in "<PHONE_12" + "x" * 5:
        restorer.feed(ch)
        assert restorer.held <= longest - 1
    assert restorer.held == 0


def test_an_empty_mapping_streams_text_at_once() -> None:
    restorer = Restorer({})
    assert restorer.feed("<EMA") == "<EMA"
    assert restorer.held == 0
    assert restorer.feed("IL_1>") == "IL_1>"
    assert restorer.restore("<EMAIL_1>") == "<EMAIL_1>"
    assert restorer.flush() == ""


def test_an_empty_placeholder_is_refused() -> None:
    with pytest.raises(ValueError):
        Restorer({"": "x"})
