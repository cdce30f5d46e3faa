from workers.stops import first_stop, held_tail


def test_the_first_stop_is_the_earliest_of_any_and_empty_ones_stop_nothing() -> None:
    assert first_stop("one. two! three", ["!", ".", ""]) == 3
    assert first_stop("no stop here", ["END", ""]) is None


def test_the_held_tail_is_the_longest_that_may_begin_a_stop() -> None:
    assert held_tail("the answer is <|e", ["<|end|>", "<|"]) == 3
    assert held_tail("the answer is <", ["<|end|>"]) == 1
    assert held_tail("plain text", ["<|end|>"]) == 0
    assert held_tail("<|end", ["<|end|>"]) == 5  # the whole text, short of the stop
