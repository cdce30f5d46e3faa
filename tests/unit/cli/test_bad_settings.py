"""A setting of the environment that does not read: one line naming it, no traceback."""

from __future__ import annotations

import pytest

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
