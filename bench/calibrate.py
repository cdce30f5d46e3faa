"""Step times of the CPU engine, for ``bench.fleet_sim``'s worker model.

Loads the packaged SmolLM2 GGUF in one ``llama_cpp.Llama`` context set up as
Conveyor's llama.cpp engine sets one up (``n_ctx`` 2048, one thread), alone
on the machine, and measures:

- prefill: the time to evaluate ``T`` new tokens with nothing cached, for a
  few ``T``, then a least-squares line ``ms = b T + c``;
- decode: milliseconds a generated token, one sequence, after a prompt of
  each length (to see whether it grows with the cache).

It prints the ``bench.fleet_sim`` flags that model such a worker
(``--prefill-ms 0,b,c --decode-ms 0,0,d``).

    python -m bench.calibrate [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.llama_direct import smollm2_gguf

__all__ = ["main"]

LENGTHS = (64, 256, 512, 1024)
N_CTX = 2048
DECODE_TOKENS = 32


def _tokens(llm: Any, n: int, salt: int) -> list[int]:
    """``n`` token ids of ordinary text, different for each ``salt`` (so nothing
    is found in the cache)."""
    text = " ".join(f"lighthouse {salt} keeper {i} wrote a note about the tide."
                    for i in range(n))
    tokens: list[int] = llm.tokenize(text.encode(), add_bos=True)
    return tokens[:n]


def prefill_ms(llm: Any, tokens: list[int]) -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(tokens)
    return (time.perf_counter() - start) * 1000


def decode_ms(llm: Any, tokens: list[int]) -> float:
    """Milliseconds a token over ``DECODE_TOKENS`` greedy tokens after ``tokens``."""
    llm.reset()
    llm.eval(tokens)
    start = time.perf_counter()
    for _ in range(DECODE_TOKENS):
        token = llm.sample(top_k=1)
        llm.eval([token])
    return (time.perf_counter() - start) * 1000 / DECODE_TOKENS


def fit(points: list[tuple[float, float]], degree: int) -> list[float]:
    """Least squares polynomial of ``degree`` through ``points``, as the three
    coefficients (A, B, C) of ``A x^2 + B x + C``."""
    import numpy as np

    coefficients = np.polyfit([x for x, _ in points], [y for _, y in points], degree)
    return [0.0] * (2 - degree) + [float(c) for c in coefficients]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.calibrate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from llama_cpp import Llama

    llm = Llama(str(smollm2_gguf()), n_ctx=N_CTX, n_threads=1, n_threads_batch=1,
                verbose=False)
    prefill: list[tuple[int, float]] = []
    decode: list[tuple[int, float]] = []
    salt = 0
    for n in LENGTHS:
        runs = []
        for _ in range(args.repeats):
            salt += 1
            runs.append(prefill_ms(llm, _tokens(llm, n, salt)))
        prefill.append((n, statistics.median(runs)))
        salt += 1
        decode.append((n, decode_ms(llm, _tokens(llm, n, salt))))
    print("| prompt tokens | prefill ms (median) | decode ms a token after it |")
    print("|---|---|---|")
    for (n, p), (_, d) in zip(prefill, decode, strict=True):
        print(f"| {n} | {p:.1f} | {d:.2f} |")
    pa, pb, pc = fit([(float(n), ms) for n, ms in prefill], 2)
    # decode against the cache's fill (bench.fleet_sim's p), the context's n_ctx the whole
    _, db, dc = fit([(n / N_CTX, ms) for n, ms in decode], 1)
    print(f"\nprefill ms = {pa:.3e} T^2 + {pb:.4f} T + {pc:.2f}; "
          f"decode ms = {db:.2f} p + {dc:.2f} (p: the share of the {N_CTX}-token context held)")
    print(f"bench.fleet_sim flags: --prefill-ms {pa:.3e},{pb:.4f},{pc:.2f} "
          f"--decode-ms 0,{db:.2f},{dc:.2f} --kv-tokens {N_CTX} --max-seqs 1")


if __name__ == "__main__":
    main()
