"""ReplyStream.put: replies reach the client in index order, once each."""

from __future__ import annotations

from typing import Literal

from gateway.replies import ReplyStream
from schemas.records import Reply
from topics.envelope import new_envelope


def reply(index: int, text: str = "",
          kind: Literal["delta", "final", "error"] = "delta") -> Reply:
    return Reply(envelope=new_envelope("r1", reply_gateway="g", reply_partition=0),
                 index=index, kind=kind, text=text, chunk="", finish_reason=None, usage=None,
                 error=None)


def drain(stream: ReplyStream) -> list[int]:
    out = []
    while not stream.queue.empty():
        out.append(stream.queue.get_nowait()["index"])
    return out


def test_in_order_replies_pass_at_once() -> None:
    s = ReplyStream("r1")
    for i in range(3):
        s.put(reply(i))
        assert drain(s) == [i]
    assert s.next_index == 3


def test_early_replies_wait_for_the_ones_before_them() -> None:
    s = ReplyStream("r1")
    s.put(reply(2))
    s.put(reply(1))
    assert drain(s) == []
    s.put(reply(0))
    assert drain(s) == [0, 1, 2]
    assert s.early == {}


def test_repeats_are_dropped() -> None:
    s = ReplyStream("r1")
    s.put(reply(0, "a"))
    s.put(reply(0, "a"))  # already passed
    s.put(reply(2, "c"))
    s.put(reply(2, "c"))  # already waiting
    assert drain(s) == [0]
    s.put(reply(1, "b"))
    assert drain(s) == [1, 2]


def test_a_replayed_stream_is_invisible() -> None:
    # postprocess replayed its log: the same replies arrive a second time
    s = ReplyStream("r1")
    for i in range(4):
        s.put(reply(i))
    for i in range(4):
        s.put(reply(i))
    s.put(reply(4, kind="final"))
    assert drain(s) == [0, 1, 2, 3, 4]


async def test_a_waiting_reader_wakes_up() -> None:
    s = ReplyStream("r1")
    s.put(reply(1))
    s.put(reply(0))
    first = await s.queue.get()
    second = await s.queue.get()
    assert (first["index"], second["index"]) == (0, 1)
