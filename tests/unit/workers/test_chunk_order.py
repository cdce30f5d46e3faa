"""ChunkOrder: one run's chunk at each seq, whoever reads the log.

Before runs were named, a retry that Redis had mistaken for a first attempt
wrote seq 0, 1, ... again, and postprocess spliced the second run's tail onto
the first run's head. Postprocess and infer's recovery now apply the same
rule, so neither a duplicated run nor a racing retry can splice an answer.
"""

from __future__ import annotations

from schemas.records import ChunkHeader, TokenChunk
from topics.envelope import new_envelope
from workers.chunk_order import ChunkOrder
from workers.infer.progress import progress_of
from workers.postprocess.stream import RequestStream


def chunk(seq: int, text: str, run: str, start: int = 0,
          finish: str | None = None) -> TokenChunk:
    head = ChunkHeader(kind="chat", model="m", created=1, stop=[], stream=True,
                       include_usage=False, prompt_tokens=1) if seq == 0 else None
    return TokenChunk(envelope=new_envelope("r", reply_gateway="g", reply_partition=0),
                      seq=seq, text=text, tokens=1, finish_reason=finish, worker_id="w",
                      header=head, error=None, run_id=run, run_start=start)


def answer(log: list[TokenChunk]) -> str:
    """What postprocess sends the client for this log."""
    stream = RequestStream(envelope=new_envelope("r", reply_gateway="g", reply_partition=0))
    return "".join(e.text for c in log for e in stream.take(c))


def test_a_second_run_from_zero_is_never_spliced_into_the_first() -> None:
    # run A wrote 0..2 and died; run B (Redis forgot A's claim) restarted at 0
    log = [chunk(0, "The ", "A"), chunk(1, "cat ", "A"), chunk(2, "sat", "A"),
           chunk(0, "A ", "B"), chunk(1, "dog ", "B"), chunk(2, "ran ", "B"),
           chunk(3, "far", "B"), chunk(4, "", "B", finish="stop")]
    assert answer(log) == "The cat sat"
    assert progress_of(log).text == "The cat sat"
    assert progress_of(log).next_seq == 3 and not progress_of(log).finished


def test_a_retry_continues_where_the_log_stops() -> None:
    log = [chunk(0, "The ", "A"), chunk(1, "cat ", "A"),
           chunk(2, "sat ", "C", start=2), chunk(3, "down", "C", start=2),
           chunk(4, "", "C", start=2, finish="stop")]
    assert answer(log) == "The cat sat down"
    assert progress_of(log).finished


def test_of_two_runs_racing_at_one_seq_the_first_in_the_log_wins() -> None:
    log = [chunk(0, "a", "A"), chunk(1, "b", "C", start=1), chunk(1, "x", "D", start=1),
           chunk(2, "y", "D", start=1), chunk(2, "c", "C", start=1),
           chunk(3, "", "C", start=1, finish="stop")]
    assert answer(log) == "abc"
    assert progress_of(log).text == "abc"


def test_the_current_run_wins_over_a_duplicate_waiting_at_the_same_seq() -> None:
    order = ChunkOrder()
    assert [c["text"] for c in order.offer(chunk(0, "a", "A"))] == ["a"]
    assert order.offer(chunk(1, "X", "B")) == []  # B began at 0: not a continuation
    assert [c["text"] for c in order.offer(chunk(1, "b", "A"))] == ["b"]
    assert order.run == "A" and order.next_seq == 2


def test_chunks_written_before_runs_were_named_form_one_run() -> None:
    log = [chunk(0, "a", ""), chunk(1, "b", ""), chunk(2, "", "", finish="stop")]
    assert answer(log) == "ab"
