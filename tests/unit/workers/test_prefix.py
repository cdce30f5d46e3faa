"""Prompt blocks, the index of which worker took which, and the choice of a worker."""

from __future__ import annotations

from tests.support.schedule_tasks import indexed_blocks, indexed_workers
from workers.prefix import (
    HeldBlocks,
    PrefixIndex,
    RoutePolicy,
    WorkerLoad,
    block_hashes,
    choose,
    tenant_salt,
)

POLICY = RoutePolicy()


def tokens(*runs: tuple[int, int]) -> list[int]:
    """Token ids made of (first id, count) runs."""
    return [first + i for first, count in runs for i in range(count)]


def test_prompts_share_hashes_exactly_as_long_as_they_share_blocks() -> None:
    system = tokens((1000, 128))  # two whole blocks of 64
    one = block_hashes(system + tokens((5, 70)), 64, 100)
    two = block_hashes(system + tokens((9, 70)), 64, 100)
    assert len(one) == len(two) == 3  # the partial last block has no hash
    assert one[:2] == two[:2] and one[2] != two[2]
    # a block with the same tokens after a different prefix is another block
    shifted = block_hashes(tokens((7, 64)) + system[:64], 64, 100)
    assert shifted[1] != one[0]
    assert all(-(2 ** 63) <= h < 2 ** 63 for h in one)  # an Avro long


def test_block_hashes_stop_at_the_limit_and_need_a_whole_block() -> None:
    assert len(block_hashes(tokens((0, 64 * 10)), 64, 4)) == 4
    assert block_hashes(tokens((0, 63)), 64, 4) == []
    assert block_hashes(tokens((0, 640)), 0, 4) == []


def test_one_prompt_of_two_tenants_shares_no_block() -> None:
    """A tenant's chain begins with its salt: the same tokens hash apart for
    another tenant, in every block, and alike again for the same tenant."""
    prompt = tokens((1000, 64 * 4))
    a = block_hashes(prompt, 64, 100, tenant_salt("acme"))
    b = block_hashes(prompt, 64, 100, tenant_salt("globex"))
    assert len(a) == len(b) == 4
    assert not set(a) & set(b)
    assert a == block_hashes(prompt, 64, 100, tenant_salt("acme"))
    assert not set(a) & set(block_hashes(prompt, 64, 100))  # nor the unsalted chain's
    # a tenant's turns still share their leading blocks
    assert block_hashes(prompt + tokens((7, 64)), 64, 100, tenant_salt("acme"))[:4] == a


def test_a_tenant_s_salt_names_no_tenant_and_sharing_empties_it() -> None:
    salt = tenant_salt("acme")
    assert salt == tenant_salt("acme") != tenant_salt("acme2")
    assert "acme" not in salt and len(salt) == 32
    assert tenant_salt("acme", shared=True) == tenant_salt("globex", shared=True) == ""
    prompt = tokens((1000, 128))
    assert block_hashes(prompt, 64, 100, tenant_salt("acme", shared=True)) == \
        block_hashes(prompt, 64, 100)


def test_routing_sends_no_tenant_to_another_s_cache() -> None:
    """w0 took tenant A's prompt; tenant B's identical prompt finds nothing
    there, and goes to the least loaded worker; A's goes back to w0."""
    prompt = tokens((1000, 64 * 4))
    index = PrefixIndex()
    a = block_hashes(prompt, 64, 100, tenant_salt("a"))
    index.took("w0", a, now_ms=0)
    loads = [WorkerLoad("w0", busy=0, capacity=4), WorkerLoad("w1", busy=0, capacity=4)]
    b = block_hashes(prompt, 64, 100, tenant_salt("b"))
    assert index.overlap("w0", b, now_ms=1) == 0
    busy_w0 = [WorkerLoad("w0", busy=1, capacity=4), WorkerLoad("w1", busy=0, capacity=4)]
    assert choose(busy_w0, b, index, POLICY, now_ms=1) == busy_w0[1]
    assert choose(busy_w0, a, index, POLICY, now_ms=1) == busy_w0[0]
    assert choose(loads, a, index, POLICY, now_ms=1) == loads[0]


def test_the_index_counts_leading_blocks_only() -> None:
    index = PrefixIndex()
    index.took("w0", [1, 2, 3], now_ms=0)
    assert index.overlap("w0", [1, 2, 3, 4], now_ms=0) == 3
    assert index.overlap("w0", [1, 9, 3], now_ms=0) == 1
    assert index.overlap("w1", [1, 2], now_ms=0) == 0


def test_the_index_is_bounded_per_worker_and_drops_the_least_recently_used() -> None:
    index = PrefixIndex(max_blocks=4)
    index.took("w0", [1, 2, 3], now_ms=0)
    index.took("w0", [1, 7, 8], now_ms=1)  # 1 used again: 2 is the oldest now
    assert indexed_blocks(index) == 4
    assert index.overlap("w0", [1, 7, 8], now_ms=1) == 3
    assert index.overlap("w0", [1, 2, 3], now_ms=1) == 1


def test_the_index_ages_blocks_out() -> None:
    index = PrefixIndex(ttl_s=10)
    index.took("w0", [1, 2], now_ms=0)
    index.took("w0", [1], now_ms=8_000)
    assert index.overlap("w0", [1, 2], now_ms=9_000) == 2
    assert index.overlap("w0", [1, 2], now_ms=12_000) == 1  # 2 was last taken at 0


def test_a_worker_whose_blocks_all_aged_out_leaves_nothing_behind() -> None:
    """Workers come and go (restarts under new ids): the index must not keep
    every id it ever saw."""
    index = PrefixIndex(ttl_s=10)
    for i in range(100):
        index.took(f"gone{i}", [i, i + 1], now_ms=i)
    index.took("w0", [7], now_ms=20_000)
    assert indexed_workers(index) == ["w0"] and indexed_blocks(index) == 1


def test_without_blocks_the_least_loaded_worker_gets_it() -> None:
    workers = [WorkerLoad("w0", 2, 2), WorkerLoad("w1", 1, 2), WorkerLoad("w2", 1, 2)]
    assert choose(workers, [], PrefixIndex(), POLICY, 0) == workers[1]  # a tie: lower id
    assert choose([], [1], PrefixIndex(), POLICY, 0) is None


def test_a_prompt_goes_to_the_worker_holding_its_prefix() -> None:
    index = PrefixIndex()
    index.took("w1", [1, 2, 3, 4], now_ms=0)
    workers = [WorkerLoad("w0", 0, 2), WorkerLoad("w1", 1, 2)]
    assert choose(workers, [1, 2, 3, 4, 5], index, POLICY, 0) == workers[1]
    # less than the cache threshold of the prompt held: by load
    assert choose(workers, [1, 6, 7, 8, 9], index, POLICY, 0) == workers[0]
    # and never when prefix-aware routing is off
    off = RoutePolicy(prefix_aware=False)
    assert choose(workers, [1, 2, 3, 4, 5], index, off, 0) == workers[0]


def test_one_hot_prefix_cannot_pile_onto_one_worker() -> None:
    """Bounded loads: no worker above 1.25 times the mean, the task counted. With
    two workers of capacity 2, the holder takes a second task while the other is
    idle, but not a third."""
    index = PrefixIndex()
    index.took("w0", [1, 2], now_ms=0)
    hot = [1, 2, 3]
    assert choose([WorkerLoad("w0", 1, 2), WorkerLoad("w1", 0, 2)], hot, index, POLICY, 0
                  ).worker_id == "w0"  # type: ignore[union-attr]
    assert choose([WorkerLoad("w0", 2, 2), WorkerLoad("w1", 0, 2)], hot, index, POLICY, 0
                  ).worker_id == "w1"  # type: ignore[union-attr]
    # a bigger worker may hold more of the load before it is bounded
    assert choose([WorkerLoad("w0", 2, 8), WorkerLoad("w1", 0, 2)], hot, index, POLICY, 0
                  ).worker_id == "w0"  # type: ignore[union-attr]


def test_a_quiet_pool_lets_the_holder_fill_half_its_slots() -> None:
    """Eight workers of 4 slots, one task running: the mean alone would bound
    every worker to one task and send the holder's next turn elsewhere; the
    slack (half its capacity) lets it take a second, not a third."""
    index = PrefixIndex()
    index.took("w0", [1, 2], now_ms=0)

    def pool(holder_busy: int) -> list[WorkerLoad]:
        return [WorkerLoad("w0", holder_busy, 4)] + [WorkerLoad(f"w{i}", 0, 4)
                                                   for i in range(1, 8)]

    assert choose(pool(1), [1, 2, 3], index, POLICY, 0).worker_id == "w0"  # type: ignore[union-attr]
    assert choose(pool(2), [1, 2, 3], index, POLICY, 0).worker_id == "w1"  # type: ignore[union-attr]
    strict = RoutePolicy(load_slack=0.0)
    assert choose(pool(1), [1, 2, 3], index, strict, 0).worker_id == "w1"  # type: ignore[union-attr]


def test_overlap_is_weighed_against_load() -> None:
    """Two holders of the prefix: the less loaded one, and a holder of a little
    less of it beats a much busier holder of a little more."""
    index = PrefixIndex()
    index.took("w0", [1, 2, 3, 4], now_ms=0)
    index.took("w1", [1, 2, 3], now_ms=0)
    workers = [WorkerLoad("w0", 3, 4), WorkerLoad("w1", 0, 4), WorkerLoad("w2", 3, 4)]
    assert choose(workers, [1, 2, 3, 4], index, POLICY, 0) == workers[1]
    even = [WorkerLoad("w0", 1, 4), WorkerLoad("w1", 1, 4), WorkerLoad("w2", 1, 4)]
    assert choose(even, [1, 2, 3, 4], index, POLICY, 0) == even[0]


def test_a_workers_report_stands_for_what_it_holds() -> None:
    """A scheduler that sent nothing (another replica's work, or its own before
    a restart) knows a worker's blocks from its heartbeat."""
    index = PrefixIndex()
    index.reported("w0", [1, 2, 3], ts_ms=1_000)
    assert index.overlap("w0", [1, 2, 3, 4], now_ms=1_500) == 3
    assert index.overlap("w1", [1, 2], now_ms=1_500) == 0
    assert indexed_workers(index) == ["w0"]


def test_a_report_covers_the_guesses_made_before_it_and_keeps_the_later_ones() -> None:
    index = PrefixIndex(report_covers_ms=2_000)
    index.took("w0", [1, 2], now_ms=0)  # evicted since, as the report says
    index.took("w0", [7, 8], now_ms=9_500)  # sent after the worker's beat was taken
    index.reported("w0", [5, 6], ts_ms=10_000)
    assert index.overlap("w0", [1, 2], now_ms=10_000) == 0
    assert index.overlap("w0", [7, 8], now_ms=10_000) == 2
    assert index.overlap("w0", [5, 6], now_ms=10_000) == 2
    # a guess and the report make one prefix together
    index.took("w0", [5, 6, 9], now_ms=10_100)
    assert index.overlap("w0", [5, 6, 9, 4], now_ms=10_200) == 3


def test_a_worker_that_does_not_report_keeps_the_guesses() -> None:
    index = PrefixIndex()
    index.took("w0", [1, 2], now_ms=0)
    index.reported("w0", None, ts_ms=10_000)
    assert index.overlap("w0", [1, 2], now_ms=10_000) == 2


def test_a_stopped_worker_is_forgotten() -> None:
    index = PrefixIndex()
    index.took("w0", [1], now_ms=0)
    index.reported("w0", [2], ts_ms=0)
    index.forget("w0")
    assert indexed_blocks(index) == 0 and indexed_workers(index) == []


def test_held_blocks_keep_the_most_recently_used() -> None:
    held = HeldBlocks(max_blocks=4)
    held.took([1, 2, 3])
    held.took([1, 7, 8])  # 1 used again
    assert held.blocks() == [3, 1, 7, 8]
    held.trim(2)
    assert held.blocks() == [7, 8]
