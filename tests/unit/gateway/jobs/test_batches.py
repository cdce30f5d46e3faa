"""Creating and cancelling a batch writes its events through the publisher's
request-path policy: the state, then the command, keyed by the batch id; a
Kafka that does not take them is a 503 and the batch is not shown."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from aiokafka.errors import KafkaConnectionError

from conveyor.errors import PipelineUnavailable
from conveyor.settings import load_settings
from gateway.auth.types import Identity
from gateway.jobs.batches import BatchCreateRequest, Batches
from gateway.jobs.board import JobBoard
from schemas.codec import default_codec
from tests.support.gateway_fakes import HANG, ScriptedProducer, publisher

SETTINGS = load_settings(topic_prefix="bt", produce_timeout_s=0.2)
ACME = Identity(tenant="acme", key_id="k1")
BODY = BatchCreateRequest(input_file_id="file-1", endpoint="/v1/chat/completions",
                          completion_window="24h")


@dataclass
class Upload:
    purpose: str = "batch"


class Files:
    async def get(self, tenant: str, file_id: str) -> Upload:
        return Upload()


def batches(producer: ScriptedProducer) -> tuple[Batches, JobBoard]:
    board = JobBoard(SETTINGS, default_codec())
    return Batches(SETTINGS, publisher(SETTINGS, producer), board, Files()), board


async def test_create_writes_the_state_then_the_command_keyed_by_the_batch() -> None:
    producer = ScriptedProducer()
    api, board = batches(producer)
    batch = await api.create(ACME, BODY)
    (status_topic, status, key1, _), (jobs_topic, command, key2, _) = producer.sent
    assert (status_topic, jobs_topic) == ("bt.job-status", "bt.jobs")
    assert key1 == key2 == batch["id"].encode()
    assert default_codec().decode(status, "JobStatus")["version"] == 0
    assert default_codec().decode(command, "JobCommand")["action"] == "create"
    assert [b["id"] for b in board.listing("acme", "batch")] == [batch["id"]]


@pytest.mark.parametrize("failure", [KafkaConnectionError("refused"), HANG])
async def test_a_kafka_that_does_not_take_the_batch_is_503_and_it_is_not_shown(
        failure: BaseException | str) -> None:
    api, board = batches(ScriptedProducer([failure]))  # type: ignore[list-item]
    with pytest.raises(PipelineUnavailable) as info:
        await api.create(ACME, BODY)
    assert info.value.status == 503
    assert board.listing("acme", "batch") == []


async def test_cancel_writes_the_cancel_command() -> None:
    producer = ScriptedProducer()
    api, _ = batches(producer)
    batch = await api.create(ACME, BODY)
    cancelling = await api.cancel(ACME, batch["id"])
    assert cancelling["status"] == "cancelling"
    (topic, value, key, _) = producer.sent[-1]
    assert (topic, key) == ("bt.jobs", batch["id"].encode())
    assert default_codec().decode(value, "JobCommand")["action"] == "cancel"
