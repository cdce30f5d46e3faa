"""``conveyor accounting`` runs below the request path's CPU priority
(``accounting_nice``, 10 by default): where the request path fills the cores,
the cold path waits; 0 leaves it at the priority it was started with."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def niceness(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[16])


def started_niceness(tmp_path: Path, **env: str) -> int:
    """The niceness of a ``conveyor accounting`` once it has started; stopped after."""
    tmp_path.mkdir()
    environ = {**os.environ, "CONVEYOR_TOPIC_PREFIX": f"t{uuid.uuid4().hex[:10]}",
               "CONVEYOR_HOME": str(tmp_path), "CONVEYOR_METRICS_PORT": "0", **env}
    with open(tmp_path / "accounting.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "accounting"], env=environ,
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            seen = niceness(proc.pid)
            if seen or "accounting" in (tmp_path / "accounting.log").read_text(errors="replace"):
                return seen
            time.sleep(0.1)
        raise AssertionError((tmp_path / "accounting.log").read_text(errors="replace"))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_accounting_app_yields_the_cores_to_the_request_path(
        services: None, tmp_path: Path) -> None:
    assert os.nice(0) == 0, "the test runs at the default priority"
    assert started_niceness(tmp_path / "a") == 10
    assert started_niceness(tmp_path / "b", CONVEYOR_ACCOUNTING_NICE="0") == 0


@pytest.mark.parametrize("value", ["-1", "20"])
def test_a_priority_out_of_range_is_refused(value: str) -> None:
    from conveyor.settings import load_settings
    with pytest.raises(ValueError, match="accounting_nice"):
        load_settings(accounting_nice=value)
