"""Markers of the integration tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: starts more than the shared services (a Kafka cluster of its own); "
        "CI runs these too")
