"""TermList and StreamScanner: whole words, folding that keeps offsets, patterns,
and a stream that catches a term across chunks without releasing any of it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.policy.safety import PATTERN_SPAN, Match, StreamScanner, TermList

CARD = r"\b\d{4}-\d{4}\b"


def found(terms: TermList, text: str) -> list[str]:
    return [text[m.start:m.end] for m in terms.all(text)]


def test_terms_match_whole_words_only() -> None:
    terms = TermList({"rude": ["ass"], "violence": ["kill"]})
    assert terms.first("a class to assess") is None
    assert terms.first("skill, killer, overkill") is None
    assert found(terms, "kill, ass.") == ["kill", "ass"]
    assert terms.first("ass") == Match("rude", "ass", 0, 3)
    assert terms.first("rk_kill") == Match("violence", "kill", 3, 7)


def test_case_does_not_matter() -> None:
    terms = TermList({"violence": ["Kill"]})
    assert terms.first("KILL") == Match("violence", "Kill", 0, 4)
    assert found(terms, "kill KiLl kILL") == ["kill", "KiLl", "kILL"]


def test_punctuation_around_a_term_is_a_boundary() -> None:
    terms = TermList({"violence": ["kill"]})
    text = "(kill) \"kill\" -kill- kill? kill…"
    assert found(terms, text) == ["kill"] * 5
    assert [m.start for m in terms.all(text)] == [1, 8, 15, 21, 27]


def test_a_multi_word_term_matches_any_run_of_whitespace_with_offsets_in_the_text() -> None:
    terms = TermList({"violence": ["how to make a bomb"]})
    text = "So, HOW to make  a\n\tbomb?"
    match = terms.first(text)
    assert match == Match("violence", "how to make a bomb", 4, 24)
    assert text[match.start:match.end] == "HOW to make  a\n\tbomb"
    assert terms.first("how to make abomb") is None
    assert terms.first("how to make a bombs") is None


def test_whitespace_in_a_term_is_one_space() -> None:
    terms = TermList({"custom": ["  project \t nightingale "]})
    text = "see Project\nNightingale."
    match = terms.first(text)
    assert match is not None and match.term == "  project \t nightingale "
    assert text[match.start:match.end] == "Project\nNightingale"


def test_a_term_with_a_non_ascii_letter() -> None:
    terms = TermList({"custom": ["Straße"]})
    assert found(terms, "die STRAẞE, die straße") == ["STRAẞE", "straße"]
    assert terms.first("Straßenbahn") is None
    assert terms.first("STRASSE") is None  # lower case, not case folding


def test_dotted_capital_i_before_a_match_keeps_offsets() -> None:
    terms = TermList({"violence": ["kill"]})
    text = "İİİ İstanbul KILL"
    match = terms.first(text)
    assert match is not None and (match.start, match.end) == (13, 17)
    assert text[match.start:match.end] == "KILL"


def test_fullwidth_forms_are_folded_and_offsets_kept() -> None:
    terms = TermList({"violence": ["kill"]})
    text = "x ＫＩＬＬ y"
    match = terms.first(text)
    assert match is not None and text[match.start:match.end] == "ＫＩＬＬ"


def test_a_combining_mark_after_a_term_joins_the_word() -> None:
    terms = TermList({"custom": ["cafe"]})
    assert terms.first("cafe\u0301") is None
    assert terms.first("cafe.") is not None


def test_categories_are_sorted_and_include_every_list() -> None:
    terms = TermList({"violence": ["kill"], "custom": []}, {"cards": [CARD]})
    assert terms.categories == ("cards", "custom", "violence")
    assert not terms.empty


def test_a_term_in_two_categories_reports_the_first_in_sorted_order() -> None:
    terms = TermList({"violence": ["kill"], "abuse": ["KILL"]})
    assert terms.first("kill") == Match("abuse", "KILL", 0, 4)
    assert terms.all("kill") == [Match("abuse", "KILL", 0, 4)]


def test_patterns_match_anywhere_case_insensitively() -> None:
    secret = r"sk-[a-z0-9]{4}"
    terms = TermList(patterns={"cards": [CARD], "secrets": [secret]})
    text = "card 1234-5678 and SK-AB12 but not 12345-6789"
    assert terms.all(text) == [Match("cards", CARD, 5, 14), Match("secrets", secret, 19, 26)]
    assert terms.first("xsk-abcd") == Match("secrets", secret, 1, 8)


def test_a_long_pattern_match_is_reported_on_a_whole_text() -> None:
    terms = TermList(patterns={"blob": [r"x{300,}"]})
    assert terms.first("a" + "x" * 400) == Match("blob", r"x{300,}", 1, 401)


@pytest.mark.parametrize(("terms", "patterns", "named"), [
    ({"custom": [""]}, None, "'custom'"),
    ({"custom": ["ok", " \n "]}, None, "' \\n '"),
    (None, {"secrets": ["sk-("]}, "'sk-('"),
    (None, {"secrets": ["x*"]}, "'x*'"),
    (None, {"secrets": [r"\b"]}, "'\\\\b'"),
    (None, {"secrets": ["(?=a)"]}, "'(?=a)'"),
    (None, {"secrets": ["abc|"]}, "'abc|'"),
])
def test_a_bad_list_is_refused_naming_the_category_and_the_entry(
        terms: dict[str, list[str]] | None, patterns: dict[str, list[str]] | None,
        named: str) -> None:
    with pytest.raises(ValueError) as caught:
        TermList(terms, patterns)
    message = str(caught.value)
    assert named in message
    assert "'custom'" in message or "'secrets'" in message


def test_the_reason_is_in_the_message() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        TermList(patterns={"p": ["("]})
    with pytest.raises(ValueError, match="empty string"):
        TermList(patterns={"p": ["a?"]})
    with pytest.raises(ValueError, match="empty term"):
        TermList({"t": ["   "]})


def test_all_is_ordered_by_start_then_end() -> None:
    terms = TermList({"violence": ["kill", "kill them all"], "rude": ["ass"]},
                     {"cards": [CARD]})
    text = "1111-2222 ass: kill them all, ass"
    assert [(m.term, m.start, m.end) for m in terms.all(text)] == [
        (CARD, 0, 9), ("ass", 10, 13), ("kill", 15, 19), ("kill them all", 15, 28),
        ("ass", 30, 33)]
    assert terms.first(text) == terms.all(text)[0]


def test_the_earliest_start_wins_over_a_match_that_ends_sooner() -> None:
    terms = TermList({"a": ["to"], "b": ["how to make a bomb"]})
    assert terms.first("how to make a bomb, to") == Match("b", "how to make a bomb", 0, 18)
    assert TermList({"a": ["to"]}).first("how to make") == Match("a", "to", 4, 6)


def test_an_empty_list() -> None:
    terms = TermList()
    assert terms.empty and terms.window == 0 and terms.categories == ()
    assert terms.first("anything") is None and terms.all("anything") == []
    assert TermList({"custom": []}).empty


def test_the_window_is_the_longest_term_or_the_pattern_span() -> None:
    assert TermList({"a": ["kill", "make  a bomb"]}).window == len("make a bomb")
    assert TermList({"a": ["kill"]}, {"p": [CARD]}).window == PATTERN_SPAN


def feed_all(scanner: StreamScanner, chunks: list[str]) -> tuple[str, Match | None]:
    released = []
    match = None
    for chunk in chunks:
        text, match = scanner.feed(chunk)
        released.append(text)
    if match is None:
        text, match = scanner.finish("")
        released.append(text)
    return "".join(released), match


def test_a_term_split_across_two_chunks_is_caught_and_none_of_it_released() -> None:
    scanner = StreamScanner(TermList({"violence": ["kill"]}))
    assert scanner.feed("we will ki") == ("we will ", None)
    assert scanner.held == 2
    assert scanner.feed("ll them") == ("", Match("violence", "kill", 8, 12))


def test_a_term_split_across_three_chunks_is_caught() -> None:
    scanner = StreamScanner(TermList({"violence": ["how to make a bomb"]}))
    out = [scanner.feed(chunk) for chunk in ("Here is how to ma", "ke  a\nb", "omb: first")]
    assert [text for text, _ in out] == ["Here is ", "", ""]
    assert [match for _, match in out][:2] == [None, None]
    assert out[2][1] == Match("violence", "how to make a bomb", 8, 27)


def test_the_text_before_a_match_is_released_exactly_once() -> None:
    terms = TermList({"violence": ["kill"]})
    scanner = StreamScanner(terms)
    released = [scanner.feed(chunk) for chunk in ("Fine. ", "Now we ", "kill", " them", " all")]
    match = Match("violence", "kill", 13, 17)
    assert "".join(text for text, _ in released) == "Fine. Now we "
    assert [m for _, m in released] == [None, None, None, match, match]
    assert scanner.finish("") == ("", match)
    assert scanner.feed("more") == ("", match)
    assert scanner.held == 0


def test_a_whole_term_at_the_end_waits_for_the_next_character() -> None:
    scanner = StreamScanner(TermList({"violence": ["kill"]}))
    assert scanner.feed("go kill") == ("go ", None)
    assert scanner.held == 4
    assert scanner.feed("s") == ("kills", None)
    assert scanner.held == 0
    assert scanner.feed(" kill") == (" ", None)
    assert scanner.finish("") == ("", Match("violence", "kill", 9, 13))


def test_text_that_cannot_begin_a_term_is_released_at_once() -> None:
    scanner = StreamScanner(TermList({"violence": ["kill"]}))
    assert scanner.feed("skil") == ("skil", None)
    assert scanner.feed("l it") == ("l it", None)
    assert scanner.held == 0


def test_finishing_releases_what_is_held() -> None:
    scanner = StreamScanner(TermList({"violence": ["kill"]}))
    assert scanner.feed("we will ki") == ("we will ", None)
    assert scanner.finish("") == ("ki", None)
    assert scanner.held == 0


def test_an_empty_list_holds_nothing() -> None:
    scanner = StreamScanner(TermList())
    assert scanner.feed("kill them") == ("kill them", None)
    assert scanner.held == 0
    assert scanner.finish("") == ("", None)


def test_a_pattern_holds_only_what_could_begin_a_match() -> None:
    scanner = StreamScanner(TermList(patterns={"secrets": [r"\bsk-[a-z0-9]{20,64}\b"]}))
    assert scanner.feed("no secret here, s") == ("no secret here, ", None)
    assert scanner.feed("ure") == ("sure", None)  # "sure" cannot begin "sk-"
    assert scanner.feed(" sk-abc") == (" ", None)
    released, match = scanner.feed("defghijklmnopqrstuvwxyz0 done")
    assert released == "" and match is not None and match.category == "secrets"
    long = StreamScanner(TermList(patterns={"cards": [CARD]}))
    text = "1234-" + "x" * 400
    assert long.feed(text)[0] == text  # a partial that more text cannot complete


def test_a_pattern_split_across_chunks_is_caught_with_stream_offsets() -> None:
    terms = TermList(patterns={"cards": [CARD]})
    scanner = StreamScanner(terms)
    text = "x" * 300 + " card 1234-56"
    released, match = scanner.feed(text)
    assert released == text[:306]  # held: only what more text could make a match
    assert scanner.held == len("1234-56")
    rest, match = scanner.feed("78 ok")
    assert match == Match("cards", CARD, 306, 315)
    assert released + rest == text[:306]


ALPHABET = "kilbomae ,\n"
TERMS = TermList({"violence": ["kill", "make a bomb"]})


@st.composite
def chunked(draw: st.DrawFn, with_term: bool) -> tuple[str, list[str]]:
    text = draw(st.text(ALPHABET, max_size=40))
    if with_term:
        at = draw(st.integers(0, len(text)))
        term = draw(st.sampled_from(["kill", "KILL", "make a bomb", "make \n a  bomb"]))
        text = f"{text[:at]} {term} {text[at:]}"
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def stream(chunks: list[str]) -> tuple[str, Match | None]:
    scanner = StreamScanner(TERMS)
    fed = released = ""
    for chunk in chunks:
        fed += chunk
        text, match = scanner.feed(chunk)
        released += text
        if match is not None:
            return released, match
        assert fed.startswith(released)
        assert len(released) + scanner.held == len(fed)
        assert len(re.sub(r"\s+", " ", fed[len(released):])) <= TERMS.window
    text, match = scanner.finish("")
    return released + text, match


@settings(max_examples=300, deadline=None)
@given(chunked(with_term=False))
def test_released_and_held_text_is_what_was_fed(case: tuple[str, list[str]]) -> None:
    text, chunks = case
    released, match = stream(chunks)
    expected = TERMS.first(text)
    assert match == expected
    assert released == (text if expected is None else text[:expected.start])


@settings(max_examples=300, deadline=None)
@given(chunked(with_term=True))
def test_a_term_is_caught_however_the_text_is_cut(case: tuple[str, list[str]]) -> None:
    text, chunks = case
    released, match = stream(chunks)
    expected = TERMS.first(text)
    assert expected is not None
    assert match == expected
    assert released == text[:expected.start]


FINISH_TERMS = TermList({"violence": ["kill", "make a bomb"]},
                        {"secrets": [r"\bsk-[a-z0-9]{3,}\b"]})


@settings(max_examples=300, deadline=None)
@given(chunked(with_term=True), st.sampled_from(["", " sk-abc", "sk-a", " ki"]))
def test_finishing_with_the_last_chunk_is_feeding_it_then_finishing(
        case: tuple[str, list[str]], tail: str) -> None:
    _, chunks = case
    *head, last = [*chunks, ""] if not chunks else chunks
    last += tail
    apart, together = StreamScanner(FINISH_TERMS), StreamScanner(FINISH_TERMS)
    for chunk in head:
        assert apart.feed(chunk) == together.feed(chunk)
    released, match = apart.feed(last)
    if match is None:
        rest, match = apart.finish("")
        released += rest
    assert together.finish(last) == (released, match)
    assert match is not None and together.finish("more") == ("", match)  # stopped at it
