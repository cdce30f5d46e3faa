"""A setting of the environment that does not read: one line naming it, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli import main as cli_main
from cli.main import main


def test_a_bad_setting_is_named_and_nothing_starts(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONVEYOR_SCHEDULE_TENANT_SHARES", "acme")
    monkeypatch.setenv("CONVEYOR_SCHEDULE_TIMEOUT_S", "soon")
    assert main(["layer"]) == 2
    err = capsys.readouterr().err
    assert "CONVEYOR_SCHEDULE_TENANT_SHARES: Value error, tenant share 'acme'" in err
    assert "CONVEYOR_SCHEDULE_TIMEOUT_S: Input should be a valid number" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("what", ["missing", "not a schema"])
def test_a_schema_history_that_does_not_read_is_named_and_nothing_starts(
        what: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    folder = tmp_path / "history"
    if what == "not a schema":
        folder.mkdir()
        (folder / "conveyor.Request.v99.avsc").write_text("{not json")
    monkeypatch.setenv("CONVEYOR_SCHEMA_HISTORY", str(folder))
    # the settings read: logging would be set up for the process (pytest owns it)
    monkeypatch.setattr(cli_main, "_setup_logging", lambda settings: None)
    assert main(["layer"]) == 2
    err = capsys.readouterr().err
    assert "CONVEYOR_SCHEMA_HISTORY: " in err and str(folder) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
