"""The simulated world of :mod:`bench.fleet_sim`: workers with prefix caches and
step times, and the workloads played on them, on a logical clock in
milliseconds (nothing sleeps). The model is described in
docs/benchmarks/index.md ("The fleet simulator's model"); the step times'
defaults are NVIDIA Dynamo mocker's polynomials (``lib/mocker``), fitted
there to a GPU engine; the CPU engine's are on the routing results page.
"""

from __future__ import annotations

import math
import random
from array import array
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from heapq import heappop, heappush
from statistics import fmean

from workers.prefix import block_hashes

__all__ = ["BLOCK_TOKENS", "SCHEDULE_BLOCKS", "Job", "PrefixCache", "StepModel", "Turn", "Worker",
           "WorkerSpec", "Workload", "chat", "shared_prefix", "worker_rate"]

BLOCK_TOKENS = 64  # settings.prefix.block_tokens
SCHEDULE_BLOCKS = 256  # settings.prefix.max_blocks: how many of a prompt's blocks schedule sees
ALL_BLOCKS = 1 << 20  # a worker's cache sees every block of a sequence


@dataclass(frozen=True)
class StepModel:
    """Step times in ms: Dynamo mocker's polynomials by default."""

    prefill: tuple[float, float, float] = (4.209989e-07, 1.518344e-02, 16.50142)  # T^2, T, 1
    decode: tuple[float, float, float] = (-25.74, 54.01, 5.74)  # p^2, p, 1
    scale: float = 1.0

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        a, b, c = self.prefill
        return self.scale * max(0.0, a * tokens * tokens + b * tokens + c)

    def decode_ms(self, share: float) -> float:
        a, b, c = self.decode
        p = min(1.0, max(0.0, share))
        return self.scale * max(1.0, (a * p + b) * p + c)


@dataclass(frozen=True)
class WorkerSpec:
    """A worker's limits (why 16 sequences: docs/benchmarks/index.md)."""

    max_seqs: int = 16
    kv_tokens: int = 4096 * BLOCK_TOKENS  # settings.schedule.route_index_blocks' worth
    prefill_budget: int = 8192
    host_tokens: int = 0  # the cache's second tier, in host memory


@dataclass(frozen=True)
class Turn:
    """One request of a workload: what schedule and the worker see of it."""

    prompt_tokens: int
    output_tokens: int
    prompt_blocks: tuple[int, ...]  # every whole block of the prompt
    seq_blocks: tuple[int, ...]  # every whole block of prompt and answer
    think_ms: float = 0.0  # before its session's next turn


@dataclass(frozen=True)
class Workload:
    name: str
    params: Mapping[str, float]
    sessions: tuple[tuple[Turn, ...], ...]  # one turn each, or a conversation's

    def turns(self) -> list[Turn]:
        return [turn for session in self.sessions for turn in session]


@dataclass(eq=False, slots=True)
class Job:
    """A request on its way: when it came, where it went, what it cost."""

    turn: Turn
    session: int
    index: int  # its turn in the session
    arrival_ms: float
    cached_tokens: int = 0
    first_ms: float = math.nan
    done_ms: float = math.nan


class PrefixCache:
    """A worker's cached KV blocks, least recently used first out."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def matched(self, blocks: tuple[int, ...]) -> int:
        """How many leading ``blocks`` the cache holds."""
        n = 0
        for block in blocks:
            if block not in self.blocks:
                break
            n += 1
        return n

    def touch(self, blocks: tuple[int, ...]) -> None:
        held, again = self.blocks, self.blocks.move_to_end
        for block in blocks:
            try:
                again(block)
            except KeyError:
                held[block] = None
        while len(held) > self.capacity:
            held.popitem(last=False)


class Worker:
    """One engine (its model: docs/benchmarks/index.md). Iterations run in segments, each up to the
    next sequence's end, so that a stretch of plain decode steps costs one event:
    ``start`` opens a segment, ``cut`` shortens it to the iteration in progress
    when a request comes in (it joins at that iteration's end, as it would
    iteration by iteration), ``end`` closes it. A segment also ends after
    ``segment_steps`` iterations: that bounds the work a cut throws away, and
    changes nothing simulated (``segment_steps=1`` is iteration by iteration)."""

    def __init__(self, spec: WorkerSpec, model: StepModel, segment_steps: int = 64) -> None:
        self.spec = spec
        self.model = model
        self.segment_steps = segment_steps
        self.cache = PrefixCache((spec.kv_tokens + spec.host_tokens) // BLOCK_TOKENS)
        self.waiting: deque[Job] = deque()
        self.stepping = False
        self._running = 0
        self._decoding = 0
        self._held = 0  # tokens of the decoding sequences
        self._reserved = 0
        self._step = 0  # iterations done
        self._ends: dict[int, list[Job]] = {}  # iteration -> the sequences ending with it
        self._end_steps: list[int] = []  # a heap of _ends' keys
        self._admitted: list[Job] = []  # at the segment's first iteration
        self._times: list[float] = []  # when each iteration of the segment ends

    def start(self, now_ms: float) -> float | None:
        """Admit what fits and open a segment at ``now_ms``: when it ends, None when idle."""
        new_tokens = self._admit()
        if not self._admitted and not self._decoding:
            return None
        model, kv = self.model, self.spec.kv_tokens
        ms = model.prefill_ms(new_tokens) if self._admitted else 0.0
        if self._decoding:
            ms += model.decode_ms(self._held / kv)
        at = now_ms + ms
        self._times = [at]
        for job in self._admitted:
            job.first_ms = at
        held = self._held + self._decoding + sum(j.turn.prompt_tokens + 1 for j in self._admitted)
        decoding = self._decoding + len(self._admitted)
        a, b, c = model.decode
        scale, times = model.scale, self._times
        # one iteration only while some request waits (for KV or the prefill budget)
        more = 0 if self.waiting else min(self.segment_steps - 1, self._end_steps[0] - self._step)
        for _ in range(more):
            p = held / kv if held < kv else 1.0
            at += scale * max(1.0, (a * p + b) * p + c)  # decode_ms inlined (the hot loop)
            times.append(at)
            held += decoding
        self.stepping = True
        return at

    def cut(self, now_ms: float) -> float | None:
        """End the segment with the iteration running at ``now_ms``: its new end,
        None when that is the end already."""
        keep = bisect_left(self._times, now_ms) + 1
        if keep >= len(self._times):
            return None
        del self._times[keep:]
        return self._times[-1]

    def end(self, now_ms: float) -> list[Job]:
        """The segment ends at ``now_ms``: the sequences that finished with it."""
        steps, admitted = len(self._times), self._admitted
        self._held += (self._decoding + sum(j.turn.prompt_tokens + 1 for j in admitted)
                       + (steps - 1) * (self._decoding + len(admitted)))
        self._decoding += len(admitted)
        self._admitted, self._times = [], []
        self._step += steps
        self.stepping = False
        last = self._step - 1
        if self._end_steps[0] != last:
            return []
        heappop(self._end_steps)
        finished = self._ends.pop(last)
        for job in finished:
            turn = job.turn
            self._held -= turn.prompt_tokens + turn.output_tokens
            self._reserved -= turn.prompt_tokens + turn.output_tokens
            self._decoding -= 1
            self._running -= 1
            self.cache.touch(turn.seq_blocks)
            job.done_ms = now_ms
        return finished

    def _admit(self) -> int:
        """Admit from the queue (docs/benchmarks/index.md): the new prompt tokens to compute."""
        spec, new_tokens = self.spec, 0
        while self.waiting and self._running < spec.max_seqs:
            job = self.waiting[0]
            turn = job.turn
            need = turn.prompt_tokens + turn.output_tokens
            if self._running and self._reserved + need > spec.kv_tokens:
                break
            cached = min(turn.prompt_tokens,
                         self.cache.matched(turn.prompt_blocks) * BLOCK_TOKENS)
            uncached = max(1, turn.prompt_tokens - cached)
            if self._admitted and new_tokens + uncached > spec.prefill_budget:
                break
            self.waiting.popleft()
            job.cached_tokens = cached
            self.cache.touch(turn.prompt_blocks)
            self._reserved += need
            self._running += 1
            new_tokens += uncached
            self._admitted.append(job)
            last = self._step + turn.output_tokens - 1
            if last not in self._ends:
                self._ends[last] = []
                heappush(self._end_steps, last)
            self._ends[last].append(job)
        return new_tokens


def worker_rate(workload: Workload, spec: WorkerSpec, model: StepModel) -> float:
    """Requests/s one worker sustains on ``workload`` with every slot busy and
    nothing cached: a slot frees every O iterations (O: the mean answer), each
    iteration decodes ``max_seqs`` sequences holding half their answers and
    prefills ``max_seqs / O`` whole prompts of the mean length, each on its own.
    The reference the ``--rates`` fractions multiply; a fleet that reuses
    prefixes does more."""
    turns = workload.turns()
    prompt = fmean(t.prompt_tokens for t in turns)
    output = fmean(t.output_tokens for t in turns)
    m = spec.max_seqs
    held = min(spec.kv_tokens, m * (prompt + output / 2))
    step_ms = model.decode_ms(held / spec.kv_tokens) + m / output * model.prefill_ms(round(prompt))
    return m / (output * step_ms / 1000.0)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return array("H", rng.randbytes(2 * n)).tolist()


def _turn(tokens: list[int], prompt: int, output: int, think_ms: float = 0.0,
          hashes: list[int] | None = None) -> Turn:
    """A turn whose prompt is ``tokens[:prompt]`` and answer the next ``output``."""
    if hashes is None:
        hashes = block_hashes(tokens[:prompt + output], BLOCK_TOKENS, ALL_BLOCKS)
    return Turn(prompt, output, tuple(hashes[:prompt // BLOCK_TOKENS]),
                tuple(hashes[:(prompt + output) // BLOCK_TOKENS]), think_ms)


def shared_prefix(requests: int, groups: int = 64, prompts: int = 16, prefix: int = 2048,
                  question: int = 128, output: int = 256, seed: int = 1) -> Workload:
    """Rounds of ``groups`` x ``prompts``, at least ``requests`` in all."""
    rng = random.Random(f"{seed}/shared-prefix")
    rounds = max(1, math.ceil(requests / (groups * prompts)))
    sessions: list[tuple[Turn, ...]] = []
    for _ in range(rounds):
        batch = []
        for _ in range(groups):
            shared = _tokens(rng, prefix)
            for _ in range(prompts):
                tokens = shared + _tokens(rng, question + output)
                batch.append((_turn(tokens, prefix + question, output),))
        rng.shuffle(batch)
        sessions.extend(batch)
    params = {"groups": groups, "prompts_per_group": prompts, "prefix_tokens": prefix,
              "question_tokens": question, "output_tokens": output, "rounds": rounds,
              "requests": len(sessions)}
    return Workload("shared-prefix", params, tuple(sessions))


def chat(requests: int, rounds: int = 5, system: int = 1024, user: int = 128,
         answer: int = 256, think_s: float = 5.0, seed: int = 1) -> Workload:
    """``ceil(requests / rounds)`` conversations of ``rounds`` turns (docs/benchmarks/index.md)."""
    rng = random.Random(f"{seed}/chat")
    clients = max(1, math.ceil(requests / rounds))
    sessions = []
    for _ in range(clients):
        tokens = _tokens(rng, system + rounds * (user + answer))
        hashes = block_hashes(tokens, BLOCK_TOKENS, ALL_BLOCKS)
        sessions.append(tuple(
            _turn(tokens, system + k * (user + answer) + user, answer,
                  rng.expovariate(1.0 / think_s) * 1000 if think_s > 0 else 0.0, hashes)
            for k in range(rounds)))
    params = {"clients": clients, "rounds": rounds, "system_tokens": system,
              "user_tokens": user, "answer_tokens": answer, "think_s_mean": think_s,
              "requests": clients * rounds}
    return Workload("chat", params, tuple(sessions))

