"""How fast a worker is, measured from the generations it ran: its prefill rate
(prompt tokens its engine did not hold in cache, over the time to the first
token) and its time per output token (the time from the first token to the
last, over the tokens after the first). Both are exponentially weighted
moving averages (each generation counts ``ALPHA``), sent in every heartbeat;
schedule weighs a worker's capacity by its speed against its pool's
(workers/schedule/layer.py), so a slower worker gets less of the work.

Generations too short to say anything are not counted: a prefill of fewer
than ``MIN_PREFILL_TOKENS`` uncached tokens (a prompt found in cache measures
the engine's overhead, not its prefill), a decode of fewer than
``MIN_DECODE_TOKENS`` tokens. The time to the first token measured here
starts when the engine is asked, so it includes a wait for a free context
inside the engine: admission (workers/schedule/room.py) keeps that short.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Speed", "ALPHA"]

ALPHA = 0.2
MIN_PREFILL_TOKENS = 16
MIN_DECODE_TOKENS = 4


@dataclass
class Speed:
    prefill_tps: float | None = None  # uncached prompt tokens a second
    tpot_ms: float | None = None  # milliseconds a token after the first

    def observe(self, prefill_tokens: int, first_s: float, decode_tokens: int,
                decode_s: float) -> None:
        """One generation: ``prefill_tokens`` uncached prompt tokens before its first
        token came ``first_s`` after it was asked, then ``decode_tokens`` more in
        ``decode_s``."""
        if prefill_tokens >= MIN_PREFILL_TOKENS and first_s > 0:
            self.prefill_tps = _ewma(self.prefill_tps, prefill_tokens / first_s)
        if decode_tokens >= MIN_DECODE_TOKENS and decode_s > 0:
            self.tpot_ms = _ewma(self.tpot_ms, 1000 * decode_s / decode_tokens)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - ALPHA) * old + ALPHA * sample
