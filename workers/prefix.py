"""Prompts as chains of token blocks, and routing that follows them
(docs/decisions/0006-prefix-aware-routing.md).

Preprocess cuts each prompt's tokens into blocks of ``block_tokens`` and
hashes them in a chain (block *i*'s hash covers every token before it), so
two prompts share their first *n* hashes exactly when they share their first
*n* blocks. Schedule keeps a :class:`PrefixIndex` of which worker holds which
blocks: each worker's heartbeat report (:class:`HeldBlocks`) as the truth as
of the beat, and its own guesses for what it sent since. :func:`choose`
scores the live workers by how much of a prompt each likely holds against
how busy each is, under a bound on load.

A tenant's chain begins with its salt (:func:`tenant_salt`), so tenants share
no prefix unless ``prefix_cache_shared``
(docs/decisions/0027-tenants-prefix-caches-apart.md).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import takewhile

__all__ = ["HeldBlocks", "PrefixIndex", "RoutePolicy", "WorkerLoad", "block_hashes", "choose",
           "load_limit", "tenant_salt"]


def tenant_salt(tenant: str, shared: bool = False) -> str:
    """The salt of ``tenant``'s cached prefixes: a digest of its name (an
    upstream that takes the salt learns no tenant's name), or ``""`` where
    caches are ``shared`` across tenants."""
    if shared:
        return ""
    return hashlib.blake2b(tenant.encode(), digest_size=16, person=b"conveyor.prefix").hexdigest()


def block_hashes(tokens: Sequence[int], block_tokens: int, limit: int,
                 salt: str = "") -> list[int]:
    """The chained hash of each whole block of ``tokens`` (at most ``limit``),
    as signed 64-bit integers (an Avro ``long``). A last partial block has none:
    only whole blocks are reused whole. A ``salt`` begins the chain, so every
    block's hash covers it: the same tokens under another salt share no hash."""
    if block_tokens <= 0:
        return []
    out: list[int] = []
    parent = salt.encode()
    for i in range(min(len(tokens) // block_tokens, limit)):
        digest = hashlib.blake2b(parent, digest_size=8)
        digest.update(array("q", tokens[i * block_tokens:(i + 1) * block_tokens]).tobytes())
        parent = digest.digest()
        out.append(int.from_bytes(parent, "big", signed=True))
    return out


@dataclass
class HeldBlocks:
    """The blocks of the prompts a worker ran, least recently used first out:
    what its KV cache holds, as far as the worker can tell (what it sends in
    its heartbeats)."""

    max_blocks: int = 1024
    _held: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def took(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._held[block] = None
            self._held.move_to_end(block)
        self.trim(self.max_blocks)

    def trim(self, max_blocks: int) -> None:
        """Keep the ``max_blocks`` most recent (the cache got smaller, or is)."""
        while len(self._held) > max(0, max_blocks):
            self._held.popitem(last=False)

    def blocks(self) -> list[int]:
        """Most recently used last."""
        return list(self._held)


@dataclass
class PrefixIndex:
    """Which worker holds which blocks: what each worker reported in its last
    heartbeat, and the guesses of this scheduler for what it sent since,
    bounded in memory and aged out."""

    max_blocks: int = 4096  # a worker's guesses, about what its KV cache holds
    ttl_s: float = 600.0
    # a guess made this long before a worker's report is covered by it (the
    # worker had taken that task by then, or it waited in its partition)
    report_covers_ms: int = 2000
    _blocks: dict[str, OrderedDict[int, int]] = field(default_factory=dict)
    _reported: dict[str, frozenset[int]] = field(default_factory=dict)

    def reported(self, worker_id: str, blocks: Sequence[int] | None, ts_ms: int) -> None:
        """``worker_id``'s heartbeat of ``ts_ms`` says its cache holds ``blocks``
        (None: it does not say, the guesses stay as they are). The guesses made
        before the beat are dropped: the report says what became of them."""
        if blocks is None:
            return
        self._reported[worker_id] = frozenset(blocks)
        guesses = self._blocks.get(worker_id)
        if guesses:
            self._age(guesses, ts_ms - self.report_covers_ms, 0)
            if not guesses:
                del self._blocks[worker_id]

    def forget(self, worker_id: str) -> None:
        """``worker_id`` stopped: it holds nothing any more."""
        self._reported.pop(worker_id, None)
        self._blocks.pop(worker_id, None)

    def took(self, worker_id: str, blocks: Sequence[int], now_ms: int) -> None:
        """``worker_id`` was sent a prompt of ``blocks``: it holds them now. The
        other workers' old blocks age out here too, and a worker with none left
        is dropped: one gone for good leaves nothing behind."""
        for other, old in list(self._blocks.items()):
            self._age(old, now_ms)
            if not old:
                del self._blocks[other]
        held = self._blocks.setdefault(worker_id, OrderedDict())
        for block in blocks:
            held[block] = now_ms
            held.move_to_end(block)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def overlap(self, worker_id: str, blocks: Sequence[int], now_ms: int) -> int:
        """How many leading ``blocks`` ``worker_id`` is likely to hold."""
        held = self._blocks.get(worker_id)
        report = self._reported.get(worker_id, frozenset())
        if held:
            self._age(held, now_ms)
        elif not report:
            return 0
        guessed: Mapping[int, int] = held or {}
        return sum(1 for _ in takewhile(lambda b: b in report or b in guessed, blocks))

    def _age(self, held: OrderedDict[int, int], now_ms: int, ttl_ms: int | None = None) -> None:
        horizon = now_ms - (int(self.ttl_s * 1000) if ttl_ms is None else ttl_ms)
        while held:
            block, seen = next(iter(held.items()))
            if seen >= horizon:
                return
            del held[block]


@dataclass(frozen=True)
class RoutePolicy:
    """The weights and bounds of :func:`choose` (settings ``CONVEYOR_ROUTE_*``)."""

    # a prompt goes by its prefix only when a worker holds at least this share of it
    cache_threshold: float = 0.3
    # no worker above this many times the mean load of the pool, the task counted
    load_bound: float = 1.25
    # what a whole prompt in cache is worth against a worker's load (busy / capacity)
    load_weight: float = 1.0
    prefix_aware: bool = True
    # whatever the mean, a worker may hold this share of its capacity
    load_slack: float = 0.5


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    busy: int  # tasks running and queued on it, as schedule sees them
    capacity: int
    # its measured speed against its pool's (1: as fast as the median): a worker
    # twice as fast counts as twice its capacity in loads and bounds
    speed: float = 1.0

    def weight(self) -> float:
        return max(1, self.capacity) * self.speed


def choose(candidates: Sequence[WorkerLoad], blocks: Sequence[int], index: PrefixIndex,
           policy: RoutePolicy, now_ms: int) -> WorkerLoad | None:
    """The worker a prompt of ``blocks`` goes to: among the workers under the
    load bound, the one with the best expected cache overlap (its share of
    the prompt's blocks) less its load, when some worker holds at least
    ``cache_threshold`` of the prompt; otherwise the least loaded. Ties go to
    the lower worker id, so the choice is reproducible."""
    if not candidates:
        return None

    def load(c: WorkerLoad) -> float:
        return c.busy / c.weight()

    least = min(candidates, key=lambda c: (load(c), c.worker_id))
    if not policy.prefix_aware or not blocks:
        return least
    total = sum(c.busy for c in candidates) + 1
    capacity = sum(c.weight() for c in candidates)
    under = [c for c in candidates if c.busy + 1 <= load_limit(c, total, capacity, policy)]
    scored = [(index.overlap(c.worker_id, blocks, now_ms) / len(blocks), c) for c in under]
    best_share = max((share for share, _ in scored), default=0.0)
    if best_share < policy.cache_threshold:
        return least
    return min(scored, key=lambda sc: (policy.load_weight * load(sc[1]) - sc[0],
                                       load(sc[1]), sc[1].worker_id))[1]


def load_limit(worker: WorkerLoad, total: int, capacity: float, policy: RoutePolicy) -> int:
    """The most tasks ``worker`` may hold when the candidates hold ``total`` (the
    task being placed counted) over ``capacity`` (their weights): ``load_bound``
    times its share of the total, or ``load_slack`` of its own capacity, and at
    least one task."""
    share = policy.load_bound * total * worker.weight() / capacity
    return max(1, math.ceil(share - 1e-9), math.floor(policy.load_slack * worker.capacity))
