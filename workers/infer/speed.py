"""How fast a worker is, measured from the generations it ran: its prefill rate
(uncached prompt tokens over the time to the first token, measured from when
the engine is asked) and its time per output token after the first, each an
exponentially weighted moving average (weight ``ALPHA``) sent in every
heartbeat; schedule weighs a worker's capacity by its speed against its
pool's. Generations too short to say anything (under ``MIN_PREFILL_TOKENS``
uncached or ``MIN_DECODE_TOKENS`` generated) are not counted.
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
