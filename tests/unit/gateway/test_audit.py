"""Audit through the publisher: the gateway's events are fire-and-forget, the
CLI's are waited for; the key is the tenant, else the actor."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiokafka.errors import KafkaConnectionError

from conveyor.errors import PipelineUnavailable
from conveyor.settings import load_settings
from gateway.audit import Audit, audit_event
from gateway.publisher import Publisher
from schemas.codec import default_codec
from tests.support.gateway_fakes import ScriptedProducer, publisher

SETTINGS = load_settings(topic_prefix="au", produce_timeout_s=0.2)


async def test_write_fills_the_actor_and_keys_by_tenant_else_actor() -> None:
    producer = ScriptedProducer()
    audit = Audit(SETTINGS, publisher(SETTINGS, producer), actor="gw-1")
    await audit.write(audit_event("key.create", tenant="acme", key_id="k1"))
    await audit.write(audit_event("dlq.redrive", actor="cli@host"))
    (topic, first, key1, _), (_, second, key2, _) = producer.sent
    assert topic == "au.audit" and (key1, key2) == (b"acme", b"cli@host")
    assert default_codec().decode(first, "AuditEvent")["actor"] == "gw-1"
    assert default_codec().decode(second, "AuditEvent")["actor"] == "cli@host"


async def test_write_says_when_kafka_does_not_take_it() -> None:
    audit = Audit(SETTINGS, publisher(SETTINGS, ScriptedProducer([KafkaConnectionError("x")])))
    with pytest.raises(PipelineUnavailable):
        await audit.write(audit_event("key.revoke", tenant="acme"))


async def test_record_never_fails_its_request_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    producer = ScriptedProducer([KafkaConnectionError("refused")] * 3)
    pub = publisher(SETTINGS, producer)
    audit = Audit(SETTINGS, pub, actor="gw-1")
    with caplog.at_level(logging.WARNING, logger="gateway.publisher"):
        for _ in range(3):
            audit.record_throttled("k", 0.0, "auth.failed", tenant="acme", reason="unknown key")
        await pub.drain(within_s=1)
    assert producer.attempts == 3 and producer.sent == []
    [line] = [r.getMessage() for r in caplog.records if r.name == "gateway.publisher"]
    assert line.startswith("the audit event auth.failed not written to au.audit")


async def test_a_cli_s_bare_producer_is_given_a_publisher_of_its_own() -> None:
    producer = ScriptedProducer()
    audit = Audit(SETTINGS, producer, actor="cli@host")  # type: ignore[arg-type]
    assert isinstance(audit.publisher, Publisher) and audit.publisher.producer is producer
    audit.record_throttled("k", 0.0, "tenant.set", tenant="acme")
    await asyncio.sleep(0.05)
    assert [key for _, _, key, _ in producer.sent] == [b"acme"]
