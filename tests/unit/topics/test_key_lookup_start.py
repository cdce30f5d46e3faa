"""A KeyLookup that cannot start (Kafka down) closes both of its clients: a
long-lived process (the gateway's console, replaying a request) would
otherwise keep a consumer and a producer open for every failed lookup."""

from __future__ import annotations

import gc
import socket
import warnings

import pytest

from conveyor.settings import load_settings
from topics.clients import KafkaConnectionError
from topics.lookup import KeyLookup


async def test_a_lookup_that_cannot_start_leaves_no_client_open() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    settings = load_settings(kafka_bootstrap=f"127.0.0.1:{port}")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(KafkaConnectionError):
            async with KeyLookup(settings):
                pass
        gc.collect()
    assert [str(w.message) for w in seen if "Unclosed" in str(w.message)] == []
