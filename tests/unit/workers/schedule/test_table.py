"""WorkerTable.live and address, fed heartbeats by hand (no Kafka)."""

from __future__ import annotations

from typing import Literal

import pytest

from conveyor.settings import Settings, load_settings
from schemas.records import WorkerHeartbeat
from topics.envelope import now_ms
from workers.schedule.table import WorkerTable, WorkerView


@pytest.fixture
def settings() -> Settings:
    return load_settings()


@pytest.fixture
def table(settings: Settings) -> WorkerTable:
    return WorkerTable(settings)


def beat(worker_id: str, *, pool: str = "cpu", running: int = 0, queued: int = 0,
         capacity: int = 4, partitions: list[int] | None = None,
         state: Literal["ready", "draining", "stopped"] = "ready",
         age_ms: int = 0, interactive_running: int = 0,
         interactive_ms: int = 0) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id, pool=pool, engine="llamacpp", models=["smollm2"], state=state,
        partitions=[0] if partitions is None else partitions, capacity=capacity,
        running=running, queued=queued, ts_ms=now_ms() - age_ms, host="h",
        gpu_utilization=None, gpu_memory_free=None,
        interactive_running=interactive_running, interactive_ms=interactive_ms)


def choose(table: WorkerTable, pool: str) -> tuple[WorkerView, int] | None:
    """The least loaded live worker of ``pool`` (by its beat and what was sent
    since) and the partition the table addresses on it."""
    candidates = table.live(pool)
    if not candidates:
        return None
    best = min(candidates, key=lambda w: (w.busy() / w.beat["capacity"], w.beat["worker_id"]))
    return best, table.address(best)


def ids(table: WorkerTable, pool: str = "cpu") -> list[str]:
    return sorted(w.beat["worker_id"] for w in table.live(pool))


def test_no_worker_no_choice(table: WorkerTable) -> None:
    assert table.live("cpu") == []
    assert choose(table, "cpu") is None


def test_apply_signals_a_change(table: WorkerTable) -> None:
    assert not table.changed.is_set()
    table.apply(beat("w0"))
    assert table.changed.is_set()


def test_the_least_loaded_worker_wins(table: WorkerTable) -> None:
    table.apply(beat("busy", running=3, partitions=[0]))
    table.apply(beat("idle", running=1, partitions=[1]))
    table.apply(beat("queued", running=0, queued=4, partitions=[2]))
    chosen = choose(table, "cpu")
    assert chosen is not None
    view, partition = chosen
    assert view.beat["worker_id"] == "idle" and partition == 1


def test_load_is_relative_to_capacity(table: WorkerTable) -> None:
    table.apply(beat("small", running=1, capacity=1, partitions=[0]))  # full
    table.apply(beat("big", running=4, capacity=16, partitions=[1]))  # a quarter
    chosen = choose(table, "cpu")
    assert chosen is not None and chosen[0].beat["worker_id"] == "big"


def test_ties_go_to_the_lowest_worker_id(table: WorkerTable) -> None:
    table.apply(beat("wb", partitions=[1]))
    table.apply(beat("wa", partitions=[0]))
    chosen = choose(table, "cpu")
    assert chosen is not None and chosen[0].beat["worker_id"] == "wa"


def test_a_stale_heartbeat_is_not_live(table: WorkerTable, settings: Settings) -> None:
    ttl_ms = int(settings.schedule.worker_ttl_s * 1000)
    table.apply(beat("old", age_ms=ttl_ms + 1000))
    table.apply(beat("fresh", age_ms=ttl_ms // 2))
    assert ids(table) == ["fresh"]


@pytest.mark.parametrize("state", ["draining", "stopped"])
def test_a_worker_that_is_not_ready_is_not_live(
        table: WorkerTable, state: Literal["draining", "stopped"]) -> None:
    table.apply(beat("w0", state=state))
    assert table.live("cpu") == []
    assert choose(table, "cpu") is None


def test_a_worker_without_partitions_is_not_live(table: WorkerTable) -> None:
    table.apply(beat("w0", partitions=[]))
    assert choose(table, "cpu") is None


def test_a_new_heartbeat_replaces_the_old_one(table: WorkerTable) -> None:
    table.apply(beat("w0"))
    table.apply(beat("w0", state="draining"))
    assert table.live("cpu") == []
    table.apply(beat("w0"))
    assert ids(table) == ["w0"]


def test_partitions_rotate_round_robin(table: WorkerTable) -> None:
    table.apply(beat("w0", partitions=[2, 5, 7], capacity=100))
    chosen = [choose(table, "cpu") for _ in range(5)]
    assert [c[1] for c in chosen if c] == [2, 5, 7, 2, 5]


def test_the_rotation_survives_a_new_heartbeat(table: WorkerTable) -> None:
    table.apply(beat("w0", partitions=[0, 1], capacity=100))
    first = choose(table, "cpu")
    table.apply(beat("w0", partitions=[0, 1], capacity=100))
    second = choose(table, "cpu")
    assert first is not None and second is not None
    assert (first[1], second[1]) == (0, 1)


def test_tasks_sent_since_the_beat_raise_the_load(table: WorkerTable) -> None:
    table.apply(beat("a", capacity=2, partitions=[0]))
    table.apply(beat("b", capacity=2, partitions=[1]))
    picks = [choose(table, "cpu") for _ in range(4)]
    assert [p[0].beat["worker_id"] for p in picks if p] == ["a", "b", "a", "b"]
    assert table.workers["a"].sent_since_beat == 2
    assert table.workers["a"].busy() == 2


def test_the_next_heartbeat_resets_the_sent_count(table: WorkerTable) -> None:
    table.apply(beat("a", capacity=2, partitions=[0]))
    table.apply(beat("b", capacity=2, running=1, partitions=[1]))
    for _ in range(2):
        chosen = choose(table, "cpu")
        assert chosen is not None and chosen[0].beat["worker_id"] == "a"
    # a's heartbeat now reports what it took: its count of tasks sent starts again
    table.apply(beat("a", capacity=2, queued=0, running=0, partitions=[0]))
    assert table.workers["a"].sent_since_beat == 0
    chosen = choose(table, "cpu")
    assert chosen is not None and chosen[0].beat["worker_id"] == "a"


def test_other_pools_are_ignored(table: WorkerTable) -> None:
    table.apply(beat("gpu0", pool="gpu", partitions=[0]))
    table.apply(beat("cpu0", pool="cpu", running=3, partitions=[4]))
    assert ids(table, "cpu") == ["cpu0"]
    assert ids(table, "gpu") == ["gpu0"]
    assert choose(table, "tpu") is None
    chosen = choose(table, "cpu")
    assert chosen is not None and chosen[0].beat["worker_id"] == "cpu0"


def test_ends_after_the_beat_free_a_slot_and_ends_before_it_do_not(table: WorkerTable) -> None:
    table.apply(beat("w0", running=2, capacity=2))
    view = table.workers["w0"]
    ts = view.beat["ts_ms"]
    table.address(view)  # one more sent since the beat
    assert view.busy() == 3
    table.finished("w0", ts - 5)  # the beat already left it out
    assert view.busy() == 3
    table.finished("w0", ts + 5)
    table.finished("unknown", ts + 5)
    assert view.busy() == 2
    table.apply(beat("w0", running=1, capacity=2))  # a new beat starts over
    assert table.workers["w0"].busy() == 1


def test_interactive_traffic_is_read_from_the_live_workers_beats(table: WorkerTable) -> None:
    assert table.interactive("cpu") == (0, 0)
    table.apply(beat("w0", interactive_running=1, interactive_ms=1000))
    table.apply(beat("w1", interactive_ms=5000))
    table.apply(beat("w2", pool="gpu", interactive_running=3, interactive_ms=9000))
    table.apply(beat("w3", interactive_running=7, interactive_ms=9999, state="draining"))
    assert table.interactive("cpu") == (1, 5000)


def test_a_worker_serves_the_models_it_names_and_is_warm_for_those_it_loaded() -> None:
    from workers.schedule.table import WorkerView, serves, warm_first

    def view(models: list[str], loaded: list[str]) -> WorkerView:
        return WorkerView({**beat("w"), "models": models, "loaded": loaded})

    both = view(["a", "b"], ["a"])
    legacy = view([], [])
    assert serves(both, "b") and not serves(both, "c") and serves(legacy, "anything")
    cold_b, warm_b = view(["a", "b"], ["a"]), view(["a", "b"], ["b"])
    assert warm_first([cold_b, warm_b], "b") == [warm_b]
    assert warm_first([cold_b], "b") == [cold_b]  # none warm: the cold one loads it
    every = view(["a", "b"], [])  # names nothing loaded: everything is
    assert warm_first([cold_b, every], "b") == [every]
