"""Folding for level-1 terms: lower case and compatibility forms one character for
one, whitespace runs as one space, and every folded offset traced back to the
original."""

from __future__ import annotations

from conveyor.policy.safety import fold


def test_ascii_text_is_lowered_and_keeps_its_offsets() -> None:
    folded = fold("Make A Bomb")
    assert folded.text == "make a bomb"
    assert [folded.origin(i) for i in range(len(folded.text))] == list(range(11))


def test_a_whitespace_run_is_one_space_and_offsets_skip_it() -> None:
    text = "how to\t\n make  a\nbomb"
    folded = fold(text)
    assert folded.text == "how to make a bomb"
    start = folded.text.index("make")
    assert text[folded.origin(start):folded.origin(start + 3) + 1] == "make"
    start = folded.text.index("bomb")
    assert text[folded.origin(start):folded.origin(start + 3) + 1] == "bomb"


def test_compatibility_forms_fold_only_where_they_stay_one_character() -> None:
    assert fold("ＫＩＬＬ").text == "kill"  # fullwidth
    assert fold("ΣΟΦΟΣ").text == "σοφοσ"  # final sigma as sigma
    assert fold("İstanbul").text == "İstanbul"  # its lower case is two characters
    assert fold("\ufb01le").text == "\ufb01le"  # the ligature is two letters in NFKC
    folded = fold("a\u00a0\u00a0b")  # no-break spaces: folded through the table
    assert folded.text == "a b" and folded.origin(2) == 3
