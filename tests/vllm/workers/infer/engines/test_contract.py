"""The engine contract (workers/infer/engines/base.py) on the vLLM engine: the
contract tests the scripted and llama.cpp engines pass
(tests/engines/workers/infer/engines/test_contract.py), run here against vLLM's
async engine with SmolLM2 in float32. The engine is the tier's (capacity 2).
The contract's test of ``close``
(``test_close_ends_a_running_generation_with_an_engine_error``) is not
collected here: test_vllm.py's test of close makes the same checks on the one
engine of its own it starts (a vLLM start, some 21 s, saved).

The contract's long request is its question with ``max_tokens=400``, which
greedy SmolLM2 in float32 answers in 8 tokens ("The capital of France is
Paris."), so the tests that walk away from a long answer leave one that has
ended; test_vllm.py aborts answers that run on (a counting prompt)."""

from __future__ import annotations

import pytest

from conveyor.errors import EngineError
from tests.engines.workers.infer.engines.test_contract import (
    collect,
    request,
    test_a_closed_consumer_task_frees_its_slot,
    test_a_continuation_goes_on_after_the_text_sent,
    test_a_stop_string_ends_the_answer_before_it,
    test_an_answer_is_pieces_then_a_finish_reason,
    test_an_empty_completion_prompt_is_answered,
    test_chat_messages_alone_are_answered,
    test_closing_a_generation_frees_its_slot,
    test_concurrent_generations_give_the_same_answer,
    test_max_tokens_ends_with_length_and_the_tokens_add_up,
    test_no_more_than_capacity_run_at_once,
    test_temperature_zero_gives_one_answer,
)
from tests.vllm.conftest import make_vllm
from workers.infer.engines.base import Engine
from workers.infer.engines.vllm import VllmEngine

__all__ = [  # the contract's tests, collected here against vLLM
    "test_a_closed_consumer_task_frees_its_slot",
    "test_a_continuation_goes_on_after_the_text_sent",
    "test_a_stop_string_ends_the_answer_before_it",
    "test_an_answer_is_pieces_then_a_finish_reason",
    "test_an_empty_completion_prompt_is_answered",
    "test_chat_messages_alone_are_answered",
    "test_closing_a_generation_frees_its_slot",
    "test_concurrent_generations_give_the_same_answer",
    "test_max_tokens_ends_with_length_and_the_tokens_add_up",
    "test_no_more_than_capacity_run_at_once",
    "test_temperature_zero_gives_one_answer",
]


@pytest.fixture
def engine(vllm_engine: VllmEngine) -> Engine:
    return vllm_engine


async def test_an_engine_not_started_refuses_with_an_engine_error() -> None:
    with pytest.raises(EngineError, match="not started"):
        await collect(make_vllm(1), request())
