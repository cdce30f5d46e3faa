"""started(): a start-up wait says what it waits for, and gives up with the reason."""

from __future__ import annotations

import asyncio
import logging

import pytest

from conveyor.errors import ConveyorError, StartupTimeout
from conveyor.startup import kafka_address, redis_address, started

log = logging.getLogger("tests.startup")


async def never() -> None:
    await asyncio.Event().wait()


async def test_a_wait_past_its_bound_is_cancelled_and_named(
        caplog: pytest.LogCaptureFixture) -> None:
    cancelled = asyncio.Event()

    async def group_join() -> None:
        try:
            await never()
        finally:
            cancelled.set()

    caplog.set_level(logging.INFO, logger=log.name)
    with pytest.raises(StartupTimeout) as caught:
        await started("consumer group conveyor.infer.cpu", group_join, within=0.3, log=log,
                      where="Kafka at 127.0.0.1:9092", note_after_s=0.1, note_every_s=0.1)
    assert isinstance(caught.value, ConveyorError)
    message = str(caught.value)
    assert "consumer group conveyor.infer.cpu" in message
    assert "Kafka at 127.0.0.1:9092" in message
    assert message.startswith("gave up after 0 s waiting for")
    assert caught.value.what == "consumer group conveyor.infer.cpu"
    assert 0.3 <= caught.value.waited_s < 10
    assert cancelled.is_set()  # the step itself was cancelled, not left running
    notes = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert notes, caplog.text
    assert all("consumer group conveyor.infer.cpu (Kafka at 127.0.0.1:9092)" in n
               for n in notes)
    assert "giving up after 0 s" in notes[0]


async def test_a_quick_step_returns_its_result_without_a_line(
        caplog: pytest.LogCaptureFixture) -> None:
    async def quick() -> int:
        return 7

    caplog.set_level(logging.INFO, logger=log.name)
    assert await started("a quick thing", quick, within=5.0, log=log) == 7
    assert not caplog.records


async def test_a_slow_step_is_noted_while_it_lasts_and_when_it_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    async def slow() -> str:
        await asyncio.sleep(0.35)
        return "loaded"

    caplog.set_level(logging.INFO, logger=log.name)
    assert await started("the engine to load", slow, within=None, log=log,
                         note_after_s=0.1, note_every_s=0.1) == "loaded"
    lines = [r.getMessage() for r in caplog.records]
    assert sum("waiting for the engine to load" in line for line in lines) >= 2, lines
    assert "giving up" not in lines[0]  # no bound: none announced
    assert "done waiting for the engine to load" in lines[-1]


async def test_refusals_are_retried_and_the_last_one_is_the_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    tries = 0

    async def refused() -> None:
        nonlocal tries
        tries += 1
        raise ConnectionRefusedError(111, "Connect call failed")

    caplog.set_level(logging.INFO, logger=log.name)
    with pytest.raises(StartupTimeout) as caught:
        await started("Redis to answer", refused, within=0.3, log=log,
                      where="Redis at 127.0.0.1:1/0", retry_on=(OSError,), pause_s=0.02,
                      note_after_s=0.1)
    assert tries > 2
    assert "ConnectionRefusedError" in str(caught.value)
    assert "ConnectionRefusedError" in caplog.text


async def test_a_refusal_that_passes_is_forgotten() -> None:
    tries = 0

    async def second_time_lucky() -> str:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise ConnectionRefusedError(111, "Connect call failed")
        return "up"

    assert await started("Kafka to answer", second_time_lucky, within=5.0, log=log,
                         retry_on=(OSError,), pause_s=0.01) == "up"


async def test_other_errors_are_raised_as_they_are() -> None:
    async def broken() -> None:
        raise ValueError("not a refusal")

    with pytest.raises(ValueError, match="not a refusal"):
        await started("something", broken, within=5.0, log=log, retry_on=(OSError,))


async def test_the_caller_cancelled_cancels_the_step() -> None:
    cancelled = asyncio.Event()

    async def step() -> None:
        try:
            await never()
        finally:
            cancelled.set()

    waiting = asyncio.create_task(started("a group join", step, within=None, log=log))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cancelled.is_set()


def test_addresses_never_show_a_password() -> None:
    assert redis_address("redis://:s3cret@redis.internal:6380/2") == \
        "Redis at redis.internal:6380/2"
    assert redis_address("redis://127.0.0.1:6379/0") == "Redis at 127.0.0.1:6379/0"
    assert "s3cret" not in redis_address("rediss://user:s3cret@host:6379/0")
    assert kafka_address("k1:9092,k2:9092") == "Kafka at k1:9092,k2:9092"
