"""RequestStream: sequence order, stop sequences across chunk boundaries, token counts."""

from __future__ import annotations

from schemas.records import ChunkHeader, ErrorInfo, TokenChunk, TokenLogprob
from topics.envelope import new_envelope
from workers.postprocess.stream import Emitted, RequestStream


def header(stop: list[str] | None = None) -> ChunkHeader:
    return ChunkHeader(kind="chat", model="m", created=1, stop=stop or [], stream=True,
                       include_usage=False, prompt_tokens=5)


def chunk(seq: int, text: str = "", *, tokens: int = 1, finish: str | None = None,
          stop: list[str] | None = None, error: ErrorInfo | None = None) -> TokenChunk:
    return TokenChunk(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                      seq=seq, text=text, tokens=tokens, finish_reason=finish,
                      worker_id="w0", header=header(stop) if seq == 0 else None, error=error)


def stream() -> RequestStream:
    return RequestStream(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0))


def feed(s: RequestStream, *chunks: TokenChunk) -> list[Emitted]:
    out: list[Emitted] = []
    for c in chunks:
        out.extend(s.take(c))
    return out


def text_of(emitted: list[Emitted]) -> str:
    return "".join(e.text for e in emitted)


def test_chunks_in_order_are_applied_one_by_one() -> None:
    s = stream()
    assert [e.text for e in s.take(chunk(0, "Hel"))] == ["Hel"]
    assert [e.text for e in s.take(chunk(1, "lo"))] == ["lo"]
    last = s.take(chunk(2, "!", finish="length"))
    assert [(e.text, e.finish_reason) for e in last] == [("!", "length")]
    assert s.done and s.order.next_seq == 3
    assert s.header is not None and s.header["prompt_tokens"] == 5


def test_an_early_chunk_waits_for_the_ones_before_it() -> None:
    s = stream()
    assert s.take(chunk(2, "c")) == []
    assert s.take(chunk(1, "b")) == []
    out = s.take(chunk(0, "a"))
    assert [e.text for e in out] == ["a", "b", "c"]
    assert s.order.waiting == {} and s.order.next_seq == 3


def test_a_repeated_chunk_is_dropped() -> None:
    s = stream()
    assert text_of(s.take(chunk(0, "a"))) == "a"
    assert s.take(chunk(0, "a")) == []  # already applied
    assert s.take(chunk(2, "c")) == []
    assert s.take(chunk(2, "c")) == []  # already waiting
    assert [e.text for e in s.take(chunk(1, "b"))] == ["b", "c"]
    assert s.completion_tokens == 3


def test_the_header_comes_from_the_first_chunk_even_when_it_arrives_late() -> None:
    s = stream()
    s.take(chunk(1, "b"))
    assert s.header is None
    s.take(chunk(0, "a", stop=["zz"]))
    assert s.header is not None and s.header["stop"] == ["zz"]


def test_a_stop_inside_one_chunk_cuts_the_text_and_finishes() -> None:
    s = stream()
    out = s.take(chunk(0, "Hello END world", stop=["END"]))
    assert len(out) == 1
    assert out[0].text == "Hello "
    assert out[0].finish_reason == "stop"
    assert out[0].stopped_early
    assert s.done
    assert s.take(chunk(1, "more")) == []  # nothing after the stop


def test_a_stop_split_across_two_chunks() -> None:
    s = stream()
    first = s.take(chunk(0, "Hello EN", stop=["END"]))
    assert [e.text for e in first] == ["Hello "]  # "EN" held back
    assert s.held == "EN"
    second = s.take(chunk(1, "D and more"))
    assert [(e.text, e.finish_reason, e.stopped_early) for e in second] == [("", "stop", True)]
    assert s.done


def test_a_stop_split_across_three_chunks() -> None:
    s = stream()
    out = feed(s, chunk(0, "ab<", stop=["<|end|>"]), chunk(1, "|en"))
    assert text_of(out) == "ab"
    assert s.held == "<|en"
    last = s.take(chunk(2, "d|>tail"))
    assert [(e.text, e.finish_reason) for e in last] == [("", "stop")]


def test_a_held_tail_is_released_when_it_is_not_a_stop() -> None:
    s = stream()
    out = feed(s, chunk(0, "x <", stop=["<|end|>"]), chunk(1, "|e"))
    assert text_of(out) == "x "
    out = s.take(chunk(2, "nx and on"))
    assert text_of(out) == "<|enx and on"
    assert s.held == "" and not s.done


def test_a_held_tail_is_released_by_the_finishing_chunk() -> None:
    s = stream()
    out = feed(s, chunk(0, "one EN", stop=["END"]), chunk(1, "", finish="length"))
    assert [(e.text, e.finish_reason) for e in out] == [("one ", None), ("EN", "length")]
    assert not out[-1].stopped_early


def test_every_character_of_a_near_miss_is_released_in_order() -> None:
    s = stream()
    pieces = ["a", "E", "N", "x", "E", "b"]
    out = feed(s, chunk(0, pieces[0], stop=["END"]),
               *[chunk(i, p) for i, p in enumerate(pieces[1:], start=1)],
               chunk(len(pieces), "", finish="stop"))
    assert text_of(out) == "aENxEb"
    assert out[-1].finish_reason == "stop" and not out[-1].stopped_early


def test_a_stop_at_the_very_start() -> None:
    s = stream()
    out = s.take(chunk(0, "STOP now", stop=["STOP"]))
    assert [(e.text, e.finish_reason, e.stopped_early) for e in out] == [("", "stop", True)]


def test_the_earliest_of_several_stops_wins() -> None:
    s = stream()
    out = s.take(chunk(0, "one two three", stop=["three", "two", "zzz"]))
    assert [(e.text, e.finish_reason) for e in out] == [("one ", "stop")]


def test_the_longest_possible_stop_prefix_is_held() -> None:
    s = stream()
    out = s.take(chunk(0, "look: ab", stop=["b!", "abc"]))
    assert text_of(out) == "look: "
    assert s.held == "ab"


def test_empty_stop_strings_are_ignored() -> None:
    s = stream()
    out = s.take(chunk(0, "text", stop=[""]))
    assert text_of(out) == "text" and not s.done and s.held == ""


def test_the_finish_reason_passes_through() -> None:
    s = stream()
    out = feed(s, chunk(0, "a"), chunk(1, "b", finish="length"))
    assert [(e.text, e.finish_reason, e.stopped_early) for e in out] == [
        ("a", None, False),
        ("b", "length", False),
    ]
    assert s.done


def test_a_stop_in_the_finishing_chunk_is_not_stopped_early() -> None:
    # The worker has ended the generation already: there is nothing to cancel.
    s = stream()
    out = s.take(chunk(0, "done. END", finish="stop", stop=["END"]))
    assert [(e.text, e.finish_reason, e.stopped_early) for e in out] == [("done. ", "stop", False)]
    s2 = stream()
    out = s2.take(chunk(0, "done. END", finish="length", stop=["END"]))
    assert [(e.finish_reason, e.stopped_early) for e in out] == [("stop", False)]


def test_an_error_chunk_ends_the_stream() -> None:
    err = ErrorInfo(status=500, type="server_error", code="engine_error", param=None,
                    message="boom")
    s = stream()
    out = feed(s, chunk(0, "a"), chunk(1, error=err))
    assert out[-1].error == err and out[-1].text == "" and out[-1].finish_reason is None
    assert s.done
    assert s.take(chunk(2, "late")) == []


def test_an_error_stops_waiting_chunks_from_being_applied() -> None:
    err = ErrorInfo(status=504, type="timeout", code=None, param=None, message="late")
    s = stream()
    assert s.take(chunk(2, "c")) == []
    assert s.take(chunk(1, error=err)) == []
    out = s.take(chunk(0, "a"))
    assert [(e.text, e.error is not None) for e in out] == [("a", False), ("", True)]


def test_completion_tokens_are_counted() -> None:
    s = stream()
    feed(s, chunk(0, "a", tokens=3), chunk(2, "c", tokens=4), chunk(1, "b", tokens=2),
         chunk(1, "b", tokens=2))
    assert s.completion_tokens == 9
    feed(s, chunk(3, "", tokens=0, finish="stop"))
    assert s.completion_tokens == 9


def token(text: str, logprob: float = -0.5) -> TokenLogprob:
    return TokenLogprob(token=text, bytes=text.encode(), logprob=logprob, top=[])


def test_logprobs_go_out_with_the_text_of_their_tokens() -> None:
    """A token goes out with the text it begins in ("Hello " holds the space of
    " E"); tokens whose text is held back (it may begin a stop sequence) wait
    with it, and the stop sequence's own tokens never go out."""
    s = stream()
    first = chunk(0, "Hello EN", stop=["END"])
    first["header"]["logprobs"] = True  # type: ignore[index]
    first["logprobs"] = [token("Hello"), token(" E"), token("N")]
    second = chunk(1, "D more", finish="stop")
    second["logprobs"] = [token("D"), token(" more")]
    out = feed(s, first, second)
    assert text_of(out) == "Hello "
    assert [[t["token"] for t in e.logprobs] for e in out] == [["Hello", " E"], []]
    assert s.pending == []


def test_a_token_holding_part_of_a_character_waits_for_the_rest() -> None:
    s = stream()
    first = chunk(0, "caf")
    first["header"]["logprobs"] = True  # type: ignore[index]
    first["logprobs"] = [token("caf"), TokenLogprob(token="\ufffd", bytes=b"\xc3",
                                                   logprob=-1.0, top=[])]
    second = chunk(1, "\u00e9!", finish="stop")
    second["logprobs"] = [TokenLogprob(token="\ufffd", bytes=b"\xa9", logprob=-1.0, top=[]),
                          token("!")]
    out = feed(s, first, second)
    assert [len(e.logprobs) for e in out] == [1, 3]
