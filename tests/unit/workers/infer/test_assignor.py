"""BusyAwareAssignor.share: running answers stay where they are."""

from __future__ import annotations

from workers.infer.assignor import share

EIGHT = list(range(8))


def test_a_joining_worker_takes_idle_partitions_only() -> None:
    # w1 holds all eight after w0 died; it runs answers on 2 and 5
    out = share(EIGHT, {"w0": [], "w1": EIGHT}, {"w1": {2, 5}})
    assert sorted(out["w0"] + out["w1"]) == EIGHT
    assert len(out["w0"]) == len(out["w1"]) == 4
    assert {2, 5} <= set(out["w1"])


def test_a_dead_members_partitions_go_to_the_survivors() -> None:
    out = share(EIGHT, {"w1": [1, 3, 5, 7], "w2": [0, 2]}, {"w1": {1}, "w2": {0}})
    assert sorted(out["w1"] + out["w2"]) == EIGHT
    assert {1, 3, 5, 7} == set(out["w1"]) and {0, 2} <= set(out["w2"])


def test_nothing_moves_when_every_member_keeps_its_share() -> None:
    before = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    assert share(EIGHT, before, {"a": {0, 1, 2, 3}, "b": set()}) == before


def test_busy_partitions_move_only_when_idle_ones_cannot_balance() -> None:
    out = share(EIGHT, {"a": EIGHT, "b": []}, {"a": set(EIGHT)})
    assert len(out["a"]) == len(out["b"]) == 4


def test_a_partition_claimed_twice_stays_with_the_member_running_on_it() -> None:
    out = share([0, 1], {"a": [0, 1], "b": [1]}, {"b": {1}})
    assert out == {"a": [0], "b": [1]}
