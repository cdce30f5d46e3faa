"""The fleet simulator: its step times, a worker's real prefix cache, and what
a tiny seeded run must show (bench/fleet_sim.py, bench/fleet_sim_model.py)."""

from __future__ import annotations

import pytest

from bench.fleet_sim import POLICIES, FleetConfig, Result, simulate
from bench.fleet_sim_model import (
    BLOCK_TOKENS,
    Job,
    PrefixCache,
    StepModel,
    Turn,
    Worker,
    WorkerSpec,
    Workload,
    shared_prefix,
    worker_rate,
)
from workers.prefix import block_hashes

# 25 groups x 8 prompts of a 512-token prefix: more prefixes than a worker's
# 128-block cache holds unless each worker keeps to a few groups
SPEC = WorkerSpec(max_seqs=4, kv_tokens=128 * BLOCK_TOKENS)
CONFIG = FleetConfig(4, SPEC)


@pytest.fixture(scope="module")
def tiny() -> Workload:
    return shared_prefix(200, groups=25, prompts=8, prefix=512, question=64, output=32, seed=3)


def run(workload: Workload, load: float, config: FleetConfig = CONFIG) -> dict[str, Result]:
    rate = load * config.workers * worker_rate(workload, config.spec, config.model)
    return {policy: simulate(workload, config, policy, rate, seed=7) for policy in POLICIES}


def turn_of(tokens: list[int], prompt: int, output: int) -> Turn:
    hashes = block_hashes(tokens, BLOCK_TOKENS, 1000)
    return Turn(prompt, output, tuple(hashes[:prompt // BLOCK_TOKENS]),
                tuple(hashes[:(prompt + output) // BLOCK_TOKENS]))


def serve(worker: Worker, job: Job, now: float = 0.0) -> float:
    """Run ``worker`` until it is idle again: when it was."""
    worker.waiting.append(job)
    while (end := worker.start(now)) is not None:
        worker.end(end)
        now = end
    return now


def test_prefill_and_decode_follow_dynamo_mockers_polynomials() -> None:
    model = StepModel()
    assert model.prefill_ms(1000) == pytest.approx(4.209989e-07 * 1e6 + 15.18344 + 16.50142)
    assert model.prefill_ms(2048) == pytest.approx(49.36, abs=0.01)
    assert model.prefill_ms(0) == 0.0  # nothing to compute, no step
    assert model.decode_ms(0.0) == pytest.approx(5.74)
    assert model.decode_ms(1.0) == pytest.approx(-25.74 + 54.01 + 5.74)
    assert model.decode_ms(3.0) == model.decode_ms(1.0)  # the KV share is at most 1
    assert StepModel(scale=2.0).prefill_ms(1000) == pytest.approx(2 * model.prefill_ms(1000))


def test_a_lone_request_waits_for_its_prefill_only() -> None:
    """On an idle fleet, TTFT is exactly one iteration: the prefill formula."""
    tokens = list(range(1000, 1000 + 1280))
    one = Workload("one", {}, ((turn_of(tokens, 1200, 80),),))
    result = simulate(one, FleetConfig(1), "least-loaded", rate_rps=1.0)
    assert result.answered == 1 and result.cache_hit == 0.0
    assert result.ttft_p50_ms == pytest.approx(StepModel().prefill_ms(1200))


def test_the_cache_counts_leading_blocks_and_drops_the_least_recently_used() -> None:
    cache = PrefixCache(capacity_blocks=4)
    cache.touch((1, 2, 3))
    assert cache.matched((1, 2, 3, 4)) == 3
    assert cache.matched((9, 1, 2)) == 0  # a prefix only: nothing after a miss counts
    cache.touch((1,))  # used again: 2 is now the oldest
    cache.touch((7, 8))  # five blocks: 2 goes
    assert cache.matched((1, 2, 3)) == 1 and cache.matched((3,)) == 1
    assert len(cache.blocks) == 4


def test_a_worker_finds_the_real_shared_prefix_and_its_own_answers() -> None:
    worker = Worker(WorkerSpec(max_seqs=2, kv_tokens=64 * BLOCK_TOKENS), StepModel())
    system = list(range(5000, 5000 + 130))
    first = system + list(range(1, 71))  # 200 tokens: 3 whole blocks, 2 of them the system's
    serve(worker, job := Job(turn_of(first + list(range(900, 964)), 200, 64), 0, 0, 0.0))
    assert job.cached_tokens == 0
    other = Job(turn_of(system + list(range(300, 370)), 200, 16), 1, 0, 0.0)
    serve(worker, other)
    assert other.cached_tokens == 2 * BLOCK_TOKENS  # the two whole blocks of the system prompt
    # the next turn: the first prompt, its answer and a question; the answer was cached too
    history = first + list(range(900, 964))
    follow = Job(turn_of(history + list(range(40, 100)), 324, 8), 0, 1, 0.0)
    serve(worker, follow)
    assert follow.cached_tokens == (264 // BLOCK_TOKENS) * BLOCK_TOKENS


def test_a_host_tier_keeps_what_the_kv_cache_had_no_room_for() -> None:
    """Two prompts of 3 blocks each on a worker whose KV cache holds 4 blocks:
    the first is gone by the time it comes again, unless a host tier holds it."""
    one, two = list(range(1000, 1192)), list(range(5000, 5192))
    found = []
    for host_tokens in (0, 4 * BLOCK_TOKENS):
        worker = Worker(WorkerSpec(max_seqs=1, kv_tokens=4 * BLOCK_TOKENS,
                                   host_tokens=host_tokens), StepModel())
        for tokens in (one, two):
            serve(worker, Job(turn_of(tokens, 192, 1), 0, 0, 0.0))
        again = Job(turn_of(one + [7] * 8, 200, 1), 0, 1, 0.0)
        serve(worker, again)
        found.append(again.cached_tokens)
    assert found == [0, 3 * BLOCK_TOKENS]


def test_prefix_aware_finds_clearly_more_in_the_caches(tiny: Workload) -> None:
    results = run(tiny, load=0.5)
    pa = results["prefix-aware"].cache_hit
    assert pa > results["least-loaded"].cache_hit + 0.15
    assert pa > results["random"].cache_hit + 0.15
    assert results["prefix-aware"].max_load_ratio <= 1.0  # choose's load bound held
    assert all(r.answered == r.arrived == 200 for r in results.values())


def test_a_run_is_the_same_for_the_same_seed(tiny: Workload) -> None:
    assert run(tiny, load=0.7) == run(tiny, load=0.7)


@pytest.mark.parametrize("budget", [SPEC.prefill_budget, 1])
def test_segments_of_iterations_change_nothing(tiny: Workload, budget: int) -> None:
    """Iteration by iteration gives the same run, also when the prefill budget
    (1: one new sequence an iteration) keeps requests waiting on a worker."""
    spec = WorkerSpec(8, SPEC.kv_tokens, budget)  # 8 slots: requests meet on a worker
    rate = 0.8 * 4 * worker_rate(tiny, spec, CONFIG.model)
    runs = [simulate(tiny, FleetConfig(4, spec, segment_steps=steps), "prefix-aware", rate, 7)
            for steps in (1, 64)]
    assert runs[0] == runs[1]


def test_nothing_is_refused_well_below_saturation(tiny: Workload) -> None:
    for result in run(tiny, load=0.25).values():
        assert result.refused == 0 and result.answered == 200


def test_past_saturation_requests_are_refused_after_the_schedule_timeout(tiny: Workload) -> None:
    strict = run(tiny, 4.0, FleetConfig(4, SPEC, schedule_timeout_s=0.5))
    patient = run(tiny, 4.0, FleetConfig(4, SPEC, schedule_timeout_s=1e6, queue_max=10**6))
    for policy in POLICIES:
        assert strict[policy].refused > 0
        assert strict[policy].answered + strict[policy].refused == 200
        assert patient[policy].refused == 0
        # a request placed in time waited at most the timeout, then one prefill step
        assert strict[policy].ttft_p99_ms < 500 + 200
        assert patient[policy].ttft_p99_ms > strict[policy].ttft_p99_ms
