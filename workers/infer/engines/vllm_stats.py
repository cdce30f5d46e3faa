"""What vLLM's own scheduler says of its KV cache, for the worker's heartbeat."""

from __future__ import annotations

from typing import Any

from workers.infer.engines.base import KvState

__all__ = ["KvWatch"]


class KvWatch:
    """vLLM's own view of its KV cache, as its scheduler reports it after each step
    to the stat loggers of ``AsyncLLM`` (its engine core runs in another process,
    so this is the one way in): the share of blocks in use, and the prompt tokens
    looked up in and found in the prefix cache. vLLM does not report how many free
    blocks hold a cached prefix, so ``cached_blocks`` is None."""

    def __init__(self) -> None:
        self.usage: float | None = None
        self.total_blocks = 0
        self.block_tokens = 0
        self.queries = 0
        self.hits = 0

    def state(self) -> KvState | None:
        if self.usage is None or not self.total_blocks:
            return None
        free = self.total_blocks - round(self.usage * self.total_blocks)
        return KvState(usage=self.usage, total_blocks=self.total_blocks, free_blocks=free,
                       cached_blocks=None, block_tokens=self.block_tokens,
                       prefix_queries=self.queries, prefix_hits=self.hits)

    def logger(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """A stat logger factory for ``AsyncLLM`` (vLLM calls it once per engine)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        watch = self

        class KvLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.config = vllm_config

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                if scheduler_stats is None:
                    return
                watch.usage = float(scheduler_stats.kv_cache_usage)
                prefix = scheduler_stats.prefix_cache_stats
                if prefix is not None:
                    watch.queries += prefix.queries
                    watch.hits += prefix.hits

            def log_engine_initialized(self) -> None:
                cache = self.config.cache_config
                watch.total_blocks = int(cache.num_gpu_blocks or 0)
                watch.block_tokens = int(cache.block_size or 0)

        return KvLogger(vllm_config, engine_index)
