"""progress_of: what the chunks an earlier attempt left in conveyor.tokens add up to."""

from __future__ import annotations

from schemas.records import TokenChunk
from topics.envelope import new_envelope
from workers.infer.progress import Progress, progress_of


def chunk(seq: int, text: str, tokens: int = 1, finish: str | None = None,
          error: bool = False) -> TokenChunk:
    return TokenChunk(
        envelope=new_envelope("r", reply_gateway="g", reply_partition=0), seq=seq, text=text,
        tokens=tokens, finish_reason=finish, worker_id="w", header=None,
        error={"status": 500, "type": "server_error", "code": None, "param": None,
               "message": "x"} if error else None)


def test_nothing_sent_is_a_fresh_start() -> None:
    assert progress_of([]) == Progress()


def test_contiguous_chunks_in_any_order_and_repeats() -> None:
    chunks = [chunk(1, "b"), chunk(0, "a", 2), chunk(1, "b"), chunk(2, "c")]
    assert progress_of(chunks) == Progress(next_seq=3, text="abc", tokens=4)


def test_a_gap_stops_the_count() -> None:
    # seq 2 never reached the log: the retry resends from there
    assert progress_of([chunk(0, "a"), chunk(1, "b"), chunk(3, "d")]).next_seq == 2


def test_a_finished_or_failed_stream_is_finished() -> None:
    assert progress_of([chunk(0, "a"), chunk(1, "", 0, "stop")]).finished
    assert progress_of([chunk(0, "", 0, error=True)]).finished
    assert not progress_of([chunk(0, "a")]).finished
