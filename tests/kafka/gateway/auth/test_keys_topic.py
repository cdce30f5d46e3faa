"""The keys topic read whole (gateway/auth/keys_topic.py, ``KeysTopic.read_all``)
on the real broker: the newest version of each key and tenant wins whatever
order the records came in, a record that does not decode is logged and
skipped, every record read is counted, and a broker that does not answer is
a transient error within the time given."""

from __future__ import annotations

import logging
import time

import pytest

from conveyor.errors import TransientBrokerError
from gateway.auth.keys_topic import KeysTopic
from gateway.auth.types import KeyRecord, Limits, TenantPolicy
from schemas.codec import default_codec
from tests.support.key_backends import backends, key_settings
from tests.support.services import free_port

pytestmark = pytest.mark.usefixtures("services")


def key(id: str, version: int, name: str = "ci") -> KeyRecord:
    return KeyRecord(id=id, tenant="acme", name=name, hash="ab" * 32,
                     limits=Limits(rpm=version), version=version)


def tenant(name: str, version: int) -> TenantPolicy:
    return TenantPolicy(name=name, limits=Limits(tpm=version * 100), version=version)


async def test_the_newest_version_of_each_key_and_tenant_wins_and_poison_is_skipped(
        caplog: pytest.LogCaptureFixture) -> None:
    settings = key_settings()
    async with backends(settings) as b:
        topic = KeysTopic(settings, b.producer)
        await topic.write_key(key("k1", 2))
        await topic.write_key(key("k1", 1))  # an older version written later
        await topic.write_key(key("k2", 1))
        await topic.write_key(key("k3", 4, name="first"))
        await topic.write_key(key("k3", 4, name="second"))  # one version twice: the later
        await topic.write_tenant(tenant("acme", 1))
        await topic.write_tenant(tenant("acme", 3))
        await topic.write_tenant(tenant("acme", 2))
        codec = default_codec()
        await b.producer.send_and_wait(topic.topic, b"not an event", key=b"k4", partition=0)
        # a key's record where a tenant's belongs
        await b.producer.send_and_wait(topic.topic, codec.encode("ApiKey", key(
            "k5", 1).event()), key=b"tenant:globex", partition=0)
        await b.producer.send_and_wait(topic.topic, codec.encode("TenantPolicy", tenant(
            "k6", 1).event()), key=b"k6", partition=0)

        with caplog.at_level(logging.ERROR, logger="gateway.auth.keys_topic"):
            snapshot = await topic.read_all(timeout_s=30)

    assert snapshot.keys == {"k1": key("k1", 2), "k2": key("k2", 1),
                             "k3": key("k3", 4, name="second")}
    assert snapshot.tenants == {"acme": tenant("acme", 3)}
    assert snapshot.records_read == 11
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 3
    assert "offset 8 (key 'k4')" in skipped[0]
    assert "offset 9 (key 'tenant:globex')" in skipped[1]
    assert "offset 10 (key 'k6')" in skipped[2]


async def test_an_empty_topic_reads_as_nothing_at_once() -> None:
    settings = key_settings()
    async with backends(settings):
        started = time.monotonic()
        snapshot = await KeysTopic(settings).read_all(timeout_s=30)
        took_s = time.monotonic() - started  # the read alone, not the teardown
    assert (snapshot.keys, snapshot.tenants, snapshot.records_read) == ({}, {}, 0)
    assert took_s < 10


async def test_a_broker_that_does_not_answer_is_a_transient_error_within_the_timeout(
        ) -> None:
    settings = key_settings(kafka_bootstrap=f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(TransientBrokerError):
        await KeysTopic(settings).read_all(timeout_s=2)
    assert time.monotonic() - started < 10
