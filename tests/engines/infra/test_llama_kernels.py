"""What infra/llama.cpp.patch changes in llama.cpp, and what it must not.

The build Conveyor installs multiplies small batches with ggml's own f16 dot
products (not tinyBLAS), two weight rows by two tokens at a time when a batch
has an even number of tokens, one at a time otherwise. Every sum is
accumulated in the same order whichever kernel takes it, so a sequence's
logits are bit for bit the same alone and beside 1, 2 or 3 other sequences:
the property that lets the batching engine promise one answer at
temperature 0."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from conveyor.registry import Registry

# Token ids of SmolLM2's vocabulary: four short prompts, one a sequence.
PROMPTS = ([1, 4093, 314, 260, 3575, 282, 4649, 47], [1, 19556, 288, 2145, 30],
           [1, 504, 3088, 282, 260], [1, 22, 23, 24, 25, 26, 27])
STEPS = 6


@pytest.fixture(scope="module")
def model() -> Iterator[ctypes.c_void_p]:
    path = Registry.load(Path("conveyor/models.toml")).resolve("smollm2").gguf_path()
    llama_cpp.llama_backend_init()
    loaded = llama_cpp.llama_model_load_from_file(str(path).encode(),
                                                  llama_cpp.llama_model_default_params())
    assert loaded, f"llama.cpp could not load {path}"
    yield loaded
    llama_cpp.llama_model_free(loaded)


def decode_together(model: ctypes.c_void_p, prompts: list[list[int]]) -> list[list[str]]:
    """Each prompt evaluated alone, then STEPS greedy steps of all the
    sequences in one batch a step (one context, one thread, as the engines
    run): a digest of each sequence's logits at each step."""
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = 1024 * len(PROMPTS)
    params.n_batch = params.n_ubatch = 64
    params.n_seq_max = len(PROMPTS)
    params.n_threads = params.n_threads_batch = 1
    params.kv_unified = True
    params.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(64, 0, 1)
    sequences = len(prompts)
    tokens = [list(p) for p in prompts]
    positions = [0] * sequences

    def add(seq: int, token: int, logits: bool) -> None:
        i = batch.n_tokens
        batch.token[i], batch.pos[i] = token, positions[seq]
        batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = 1, seq, logits
        positions[seq] += 1
        batch.n_tokens += 1

    def logits(i: int) -> bytes:
        return ctypes.string_at(llama_cpp.llama_get_logits_ith(ctx, i), n_vocab * 4)

    def greedy(raw: bytes) -> int:
        values = memoryview(raw).cast("f")
        return max(range(n_vocab), key=values.__getitem__)

    digests: list[list[str]] = [[] for _ in range(sequences)]
    try:
        for seq in range(sequences):
            batch.n_tokens = 0
            for j, token in enumerate(tokens[seq]):
                add(seq, token, j == len(tokens[seq]) - 1)
            assert llama_cpp.llama_decode(ctx, batch) == 0
            tokens[seq].append(greedy(logits(-1)))
        for _ in range(STEPS):
            batch.n_tokens = 0
            for seq in range(sequences):
                add(seq, tokens[seq][-1], True)
            assert llama_cpp.llama_decode(ctx, batch) == 0
            for seq in range(sequences):
                raw = logits(seq)
                digests[seq].append(hashlib.sha1(raw).hexdigest())
                tokens[seq].append(greedy(raw))
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    return digests


def test_logits_are_the_same_alone_and_in_batches_of_two_three_and_four(
        model: ctypes.c_void_p) -> None:
    alone = [decode_together(model, [prompt])[0] for prompt in PROMPTS]
    for sequences in (2, 3, 4):
        together = decode_together(model, list(PROMPTS[:sequences]))
        for seq in range(sequences):
            assert together[seq] == alone[seq], (
                f"sequence {seq}'s logits differ batched with {sequences - 1} other(s)")


def test_the_installed_build_carries_the_patch() -> None:
    """The small-batch bound of the patch is read from GGML_SGEMM_MIN_N: a build
    without that name in its CPU backend was not patched."""
    lib = Path(llama_cpp.__file__).parent / "lib"
    backends = sorted(lib.glob("libggml-cpu*.so*"))
    assert backends, f"no CPU backend in {lib}"
    assert any(b"GGML_SGEMM_MIN_N" in p.read_bytes() for p in backends)
