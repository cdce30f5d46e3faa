"""Which chunk of a request's token log the client sees at each sequence number.

Every attempt at a task is a *run* with an id of its own; a run that
continues a request reads the log first and writes from the next seq on,
saying where it began (``run_start``). Two runs may still write the same seq
(a duplicated task while Redis had lost its lease, a retry that raced a live
run). Everyone who reads the log (postprocess, infer, tools) applies, in log
order, at each seq: a chunk of the run applied so far; else one of a run that
*began* at this seq; never one of any other run (it would splice a second
answer into the first). Chunks with ``run_id == ""`` form one run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.records import TokenChunk

__all__ = ["ChunkOrder"]


@dataclass
class ChunkOrder:
    next_seq: int = 0
    # the run whose chunks were applied last (None before the first)
    run: str | None = None
    waiting: dict[int, list[TokenChunk]] = field(default_factory=dict)

    def offer(self, chunk: TokenChunk) -> list[TokenChunk]:
        """Take one chunk (in log order); return those now applicable, in seq order."""
        seq = chunk["seq"]
        if seq < self.next_seq:
            return []
        self.waiting.setdefault(seq, []).append(chunk)
        out: list[TokenChunk] = []
        while self.next_seq in self.waiting:
            pick = self._pick(self.waiting[self.next_seq])
            if pick is None:
                break
            del self.waiting[self.next_seq]
            self.run = pick.get("run_id", "")
            out.append(pick)
            self.next_seq += 1
        return out

    def _pick(self, candidates: list[TokenChunk]) -> TokenChunk | None:
        for chunk in candidates:
            if self.run is None or chunk.get("run_id", "") == self.run:
                return chunk
        for chunk in candidates:
            if chunk.get("run_start", 0) == chunk["seq"]:
                return chunk
        return None
