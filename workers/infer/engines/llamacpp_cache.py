"""The KV caches of finished conversations, kept in host memory.

* **Saved when evicted**: a slot about to throw away at least ``min_tokens``
  of what it holds copies its sequence's cells out
  (``llama_state_seq_get_data``) under its tokens.
* **Restored when it beats the slot**: a saved prefix ``min_tokens`` longer
  than what the chosen slot shares with the prompt is copied in
  (``llama_state_seq_set_data``; the model's own bytes, the same answer) and
  leaves the cache.
* **Bounded in bytes**, least recently used out; one lock, copies outside it.
* **Keyed by salt and tokens**: restored only for a prompt of the same salt
  (workers/prefix.py), so no tenant gets another's cells.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt

from schemas import records

__all__ = ["HostCache", "kv_bytes_per_token"]

_Key = tuple[str, tuple[int, ...]]  # a salt and the tokens a sequence holds


@dataclass
class _Entry:
    salt: str
    tokens: tuple[int, ...]
    state: bytearray
    ids: npt.NDArray[np.intc]  # the tokens again, compared at C speed


def _shared(ids: npt.NDArray[np.intc], prompt: npt.NDArray[np.intc]) -> int:
    """How many leading tokens two arrays share."""
    n = min(len(ids), len(prompt))
    differ = np.flatnonzero(ids[:n] != prompt[:n])
    return int(differ[0]) if len(differ) else n


class HostCache:
    """Saved sequences of one model's contexts, at most ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, min_tokens: int = 64) -> None:
        self.capacity_bytes = capacity_bytes
        self.min_tokens = min_tokens
        self._lock = threading.Lock()
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self._bytes = 0
        self.stats = records.HostCache(held_bytes=0, entries=0, saved=0, restored=0, evicted=0)

    def save(self, ctx: Any, seq_id: int, held: Sequence[int], salt: str = "") -> None:
        """Copies sequence ``seq_id`` of ``ctx``, whose cells hold ``held`` (of
        prompts of ``salt``), out (unless it is here already)."""
        tokens = tuple(held)
        key = (salt, tokens)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
        size = llama_cpp.llama_state_seq_get_size(ctx, seq_id)
        if size <= 0 or size > self.capacity_bytes:
            return
        state = bytearray(size)
        buffer = (ctypes.c_uint8 * size).from_buffer(state)
        written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, seq_id)
        del buffer  # the bytearray may not be resized while a view exports it
        if written <= 0:
            return
        del state[written:]
        with self._lock:
            # a saved prefix of this sequence (of its salt) is held by it now
            for other in [k for k in self._entries if k[0] == salt and len(k[1]) < len(tokens)
                          and tokens[:len(k[1])] == k[1]]:
                self._drop(other)
            self._entries[key] = _Entry(salt, tokens, state, np.array(tokens, dtype=np.intc))
            self._bytes += len(state)
            self.stats["saved"] += 1
            while self._bytes > self.capacity_bytes and self._entries:
                self._drop(next(iter(self._entries)))
                self.stats["evicted"] += 1
            self._count()

    def take(self, tokens: Sequence[int], at_least: int, salt: str = "") -> _Entry | None:
        """The saved sequence of ``salt`` sharing the most leading tokens with
        ``tokens``, if that is ``at_least`` tokens, out of the cache: the
        context it goes into holds it now (and saves it again, grown, when it
        moves on)."""
        best: _Key | None = None
        longest = at_least - 1
        prompt = np.array(tokens, dtype=np.intc)
        with self._lock:
            # hundreds of saved conversations may share a long system prompt
            for key, entry in self._entries.items():
                if entry.salt != salt:
                    continue
                n = _shared(entry.ids, prompt)
                if n > longest:
                    best, longest = key, n
            if best is None:
                return None
            entry = self._entries[best]
            self._drop(best)
            return entry

    def restore(self, ctx: Any, seq_id: int, entry: _Entry) -> bool:
        """Sequence ``seq_id`` of ``ctx`` emptied and given ``entry``'s cells
        (which hold ``entry.tokens``); False: it could not be, and stays empty."""
        memory = llama_cpp.llama_get_memory(ctx)
        llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
        state = entry.state
        buffer = (ctypes.c_uint8 * len(state)).from_buffer(state)
        try:
            restored = llama_cpp.llama_state_seq_set_data(ctx, buffer, len(state), seq_id) > 0
        finally:
            del buffer
        if not restored:
            llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)  # a partial copy is no cache
            return False
        with self._lock:
            self.stats["restored"] += 1
        return True

    def _drop(self, key: _Key) -> None:
        entry = self._entries.pop(key)
        self._bytes -= len(entry.state)
        self._count()

    def _count(self) -> None:
        self.stats["held_bytes"] = self._bytes
        self.stats["entries"] = len(self._entries)


def kv_bytes_per_token(metadata: dict[str, str]) -> int | None:
    """A token's keys and values in f16 over every layer (llama.cpp's default
    cache type), from a GGUF's metadata; None where it lacks the keys."""
    arch = metadata.get("general.architecture", "")
    try:
        layers = int(metadata[f"{arch}.block_count"])
        heads = int(metadata[f"{arch}.attention.head_count"])
        kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", heads))
        width = int(metadata[f"{arch}.embedding_length"])
    except (KeyError, ValueError):
        return None
    return layers * kv_heads * (width // heads) * 2 * 2 if heads else None
