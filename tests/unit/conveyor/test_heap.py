"""A serving process's collector: settled once it has started (everything alive
frozen, the youngest generation's threshold raised), or left as Python sets it.
Each case runs in a child interpreter: freezing the test process's own heap
would keep every later test's cycles alive."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

import cli.main as cli_main
from conveyor import heap
from conveyor.settings import load_settings

_PROBE = """
import gc, json, sys
from conveyor.heap import settle
before = gc.get_threshold()
settle(int(sys.argv[1]), "probe")
print(json.dumps({"before": before, "after": gc.get_threshold(),
                  "frozen": gc.get_freeze_count()}))
"""


def _probe(threshold: int) -> dict[str, list[int] | int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(threshold)], check=True,
                         capture_output=True, text=True, timeout=60)
    result: dict[str, list[int] | int] = json.loads(out.stdout)
    return result


def test_settling_freezes_what_the_process_built_and_raises_the_young_threshold() -> None:
    found = _probe(10_000)
    before, after = found["before"], found["after"]
    assert isinstance(before, list) and isinstance(after, list)
    assert after == [10_000, *before[1:]]
    assert isinstance(found["frozen"], int) and found["frozen"] > 1_000  # the imported modules


def test_a_threshold_of_zero_leaves_the_collector_as_python_sets_it() -> None:
    found = _probe(0)
    assert found["after"] == found["before"] and found["frozen"] == 0


def test_a_process_settles_once_every_part_of_it_has_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, str]] = []
    monkeypatch.setattr(heap, "settle", lambda threshold, what: calls.append((threshold, what)))

    async def scenario() -> None:
        first, second = asyncio.Event(), asyncio.Event()
        settling = asyncio.create_task(
            cli_main._settle_when(load_settings(gc_threshold=5_000), "layers", first, second))
        first.set()
        await asyncio.sleep(0.01)
        assert calls == []  # one part is still starting
        second.set()
        await asyncio.wait_for(settling, 5)

    asyncio.run(scenario())
    assert calls == [(5_000, "layers")]
