"""A Conveyor of real processes whose two infer workers run vLLM
(``conveyor infer --engine vllm``, SmolLM2 in float32) against the shared
broker and Redis: answers through the whole pipeline, and a worker SIGKILLed
mid-stream whose answer the other vLLM worker finishes, whole and in order.

Two vLLM workers fit this 2-core, 24 GiB machine: each is a worker process and
vLLM's two engine processes (an engine core and its model runner), and the
two start side by side in 70-110 s.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from tests.faults.test_delivery import _chunks_of, _worker_of, count
from tests.support.pipeline import ROOT, Pipeline, client
from workers.infer.progress import progress_of

VLLM = ("--engine", "vllm", "--dtype", "float32", "--kv-cache-gib", "0.5",
        "--max-model-len", "1024")
WORKERS = 2


@pytest.fixture(scope="module")
def vllm_pipeline(services: None, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("vllm-logs"), engine=VLLM)
    try:
        # Pipeline.start, with room for two vLLM engines starting on two cores
        subprocess.run([sys.executable, "-m", "cli", "topics"], env=p.env, check=True,
                       cwd=ROOT, capture_output=True)
        p.spawn("layers", "layer")
        for i in range(WORKERS):
            p.start_worker(f"w{i}", contexts=2)
        p.spawn("gateway", "gateway")
        p.wait_ready(timeout=300)
        p.wait_workers(WORKERS, timeout=120)
        yield p
    finally:
        p.close(grace_s=20)



def engine_cores(p: Pipeline, worker: str) -> list[psutil.Process]:
    """vLLM's engine-core processes the worker started (its children)."""
    try:
        return psutil.Process(p.procs[worker].pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_the_readme_question_is_answered_through_the_pipeline(vllm_pipeline: Pipeline) -> None:
    c = client(vllm_pipeline)
    r = c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0)

    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.prompt_tokens > 10
    streamed = list(c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0, stream=True))
    assert "".join(e.choices[0].delta.content or "" for e in streamed if e.choices) == \
        r.choices[0].message.content


def test_a_prefix_cache_hit_shows_in_the_usage(vllm_pipeline: Pipeline) -> None:
    """Three asks sharing a long system prompt: with two workers, at least two land
    on one of them, and the later one's prompt comes partly from vLLM's prefix cache,
    as ``usage.prompt_tokens_details.cached_tokens`` says."""
    c = client(vllm_pipeline)
    rules = " ".join(f"Rule {i}: answer briefly and politely." for i in range(40))
    cached: list[int] = []
    for question in ("Name a colour.", "Name a fruit.", "Name a river."):
        r = c.chat.completions.create(
            model="smollm2", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": rules},
                      {"role": "user", "content": question}])
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached.append(r.usage.prompt_tokens_details.cached_tokens or 0)
        assert 0 <= cached[-1] <= r.usage.prompt_tokens
    assert max(cached) >= 200, cached  # the shared rules: about 400 tokens, 16 a block


def test_a_seeded_sample_is_the_same_through_the_pipeline(vllm_pipeline: Pipeline) -> None:
    c = client(vllm_pipeline)

    def ask(seed: int) -> str:
        r = c.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=16,
                                 temperature=1.0, seed=seed)
        return r.choices[0].text

    assert ask(7) == ask(7)
    assert any(ask(s) != ask(7) for s in (8, 9))


def test_a_worker_killed_mid_stream_is_finished_by_the_other_whole(
        vllm_pipeline: Pipeline) -> None:
    p = vllm_pipeline
    whole = count(p, 300)  # uninterrupted: the answer a retry must give too
    assert whole.counted_on() and len(whole.numbers()) > 50, whole.text
    killed: list[str] = []
    orphans: list[psutil.Process] = []

    def kill(request_id: str) -> None:
        killed.append(_worker_of(p, request_id))
        orphans.extend(engine_cores(p, killed[0]))
        p.kill(killed[0])

    started = time.monotonic()
    answer = count(p, 300, kill)
    print(f"the answer ended {time.monotonic() - started:.1f} s after it began, "
          f"{killed} SIGKILLed after three pieces")

    assert killed and answer.dones == 1 and answer.finishes == 1
    assert answer.text == whole.text  # continued where it stopped, not started over
    chunks = sorted(_chunks_of(p, answer.request_id), key=lambda c: c["seq"])
    by_worker = [c["worker_id"] for c in chunks]
    switch = by_worker.index(next(w for w in by_worker if w != killed[0]))
    assert set(by_worker[:switch]) == {killed[0]} and killed[0] not in by_worker[switch:]
    assert chunks[switch]["envelope"]["attempt"] == 1
    assert progress_of(chunks).finished
    # the killed worker's engine core does not outlive it (its memory comes back)
    assert orphans
    gone, alive = psutil.wait_procs(orphans, timeout=30)
    assert not alive, f"vLLM engine cores left running: {alive}"
