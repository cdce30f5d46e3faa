"""What a cached sequence is worth to a prompt (llamacpp_batch_context): the arithmetic
both llama.cpp engines choose a context or slot by."""

from __future__ import annotations

from workers.infer.engines.llamacpp_batch_context import common_prefix, reuse_score


def test_the_common_prefix_stops_at_the_first_difference() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_a_cache_is_worth_what_it_reuses_less_what_it_throws_away() -> None:
    history = list(range(100))
    assert reuse_score(history, [*history, 100, 101]) == 100  # the next turn
    # another conversation sharing the template's first 5 tokens: worth nothing
    assert reuse_score(history, [*history[:5], 500, 501]) == 0
    assert reuse_score([], [1, 2]) == 0
    # a long cached prompt kept in part, the rest thrown away: worth the difference
    assert reuse_score(history, [*history[:80], 500, 501]) == 60


def test_a_cache_holding_the_whole_prompt_is_worth_all_of_it() -> None:
    # a repeated prompt whose earlier answer (60 tokens) is longer than it (40)
    prompt = list(range(40))
    answered = [*prompt, *range(1000, 1060)]
    assert reuse_score(answered, prompt) == 40
    assert reuse_score(answered, [*prompt[:39], 7]) == 39  # its last token differs
    assert reuse_score(answered, [*prompt[:38], 7, 8]) == 0  # another question
