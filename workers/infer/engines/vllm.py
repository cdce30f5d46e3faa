"""An engine that runs vLLM's async engine (``AsyncLLM``) in the infer worker's
process: continuous batching of up to ``capacity`` sequences (vLLM's
``max_num_seqs``, and a semaphore before vLLM sees a generation), automatic
prefix caching with the request's ``cache_salt``, one piece per engine step.
``bash infra/vllm.sh`` installs vLLM into ``.venv-vllm``; why it runs in the
worker and what it measured: docs/decisions/0011-vllm-in-the-worker.md.

* ``--vllm-model`` names a Hugging Face directory; without it the pool's GGUF
  is converted once (:mod:`vllm_weights`, in a child process). dtype
  ``auto``: float32 on a CPU, bfloat16 on a GPU.
* A generation that ends early is aborted in vLLM at once; each has a vLLM
  request id of its own (a retry may run beside the attempt it replaces).
* Sampling maps onto ``SamplingParams`` (no top-k or min-p, not the model's
  ``generation_config.json``); ``logit_bias`` and ``logprobs`` are vLLM's own.
  A response_format is vLLM's structured outputs (a tools format as its
  GBNF), which cannot begin inside a schema: a structured answer another run
  began ends with an EngineError (the llama.cpp engine continues it).
* Pieces are deltas whose tokens add up to vLLM's count; the last carries the
  prompt's tokens and ``cached_tokens``. An empty prompt is the
  beginning-of-sequence token alone; a chat without a rendered prompt gets the
  model's chat template.
* vLLM's engine core is a child process (guard the entry point with ``if
  __name__ == "__main__"``); usage statistics are off, nothing is fetched
  from a hub, and a watch process (:mod:`vllm_watch`) ends vLLM's processes
  when the worker is SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from conveyor.errors import EngineError
from conveyor.registry import ModelSpec
from schemas.answer_format import grammar_of
from schemas.records import KvCache, TokenLogprob, TopLogprob
from workers.infer.engines.base import Engine, GenerationRequest, Piece, message_parts

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["Dtype", "VllmEngine", "vllm_missing", "sampling_params", "delta_logprobs",
           "structured_outputs", "KvWatch"]

log = logging.getLogger(__name__)


Dtype = Literal["auto", "float32", "bfloat16", "float16"]


def vllm_missing() -> str | None:
    """Why vLLM cannot be imported here, or None when it can."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"vLLM is not installed in this Python ({exc}): run bash infra/vllm.sh, " \
               "then .venv-vllm/bin/conveyor (or .venv-vllm/bin/python -m cli)"
    return None


class VllmEngine(Engine):
    """Serves ``capacity`` sequences at once from vLLM's async engine."""

    name = "vllm"
    # vLLM's own structured outputs (the tools' grammar too), logit_bias and logprobs
    constrains_output = decodes_tools = biases_logits = reports_logprobs = True
    # a vision model's images, as multi_modal_data (a text model's requests with
    # images are refused before they reach a worker: the registry's vision)
    sees_images = True

    def __init__(
        self,
        spec: ModelSpec,
        *,
        model: Path | None = None,
        capacity: int = 8,
        dtype: Dtype = "auto",
        max_model_len: int | None = None,
        kv_cache_gib: float = 1.0,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        models_file: Path | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be positive")
        self.capacity = capacity
        self.spec = spec
        self.model = model
        self.dtype = dtype
        self.max_model_len = min(max_model_len or spec.context_length, spec.context_length)
        self.kv_cache_gib = kv_cache_gib
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.models_file = models_file
        self._llm: AsyncLLM | None = None
        self._slots: asyncio.Semaphore | None = None
        self._live: set[str] = set()  # vLLM request ids of the generations now running
        self._waiting = 0  # generations waiting for a slot
        self._bos: list[int] = []
        self._watch: subprocess.Popen[bytes] | None = None  # see vllm_watch
        self.started_s = 0.0  # how long start() took
        self._kv = KvWatch()  # what vLLM's scheduler last said of its KV cache

    @property
    def served(self) -> list[str]:
        """The one model it serves (the worker's heartbeat names it)."""
        return [self.spec.name]

    @property
    def running(self) -> int:
        """Generations holding a slot now."""
        return len(self._live)

    @property
    def llm(self) -> AsyncLLM:
        """vLLM's engine (started), for what the contract does not cover."""
        if self._llm is None:
            raise EngineError(f"engine {self.name} is not started")
        return self._llm

    async def start(self) -> None:
        """Find (or convert) the weights, then start vLLM's engine: its core
        process loads the model and allocates the KV cache (tens of seconds on a
        small CPU: docs/decisions/0011-vllm-in-the-worker.md). vLLM reads its
        settings from the environment in its own processes too, so they are set
        here, where the user has not."""
        if self._llm is not None:
            return
        missing = vllm_missing()
        if missing:
            raise EngineError(missing)
        began = time.monotonic()
        model = self.model
        if model is None:
            from workers.infer.engines.vllm_weights import prepare_in_child

            model = await prepare_in_child(self.spec, self.models_file)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # Conveyor's logging rules
        before = _descendants()
        try:
            self._llm = self._engine(model)
        except Exception as exc:
            raise EngineError(f"vLLM cannot serve {model}: {exc}") from exc
        self._watch = _watch(_descendants() - before)
        tokenizer = self._llm.get_tokenizer()
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None \
            else tokenizer.eos_token_id
        self._bos = [] if bos is None else [int(bos)]
        self._slots = asyncio.Semaphore(self.capacity)
        self.started_s = time.monotonic() - began
        log.info("vLLM serves %s from %s (%s, max_model_len %d, %d sequences) after %.1f s",
                 self.spec.name, model, self._dtype(), self.max_model_len, self.capacity,
                 self.started_s)

    def _dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        from vllm.platforms import current_platform

        return "float32" if current_platform.is_cpu() else "bfloat16"

    def _engine(self, model: Path) -> AsyncLLM:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(model),
            served_model_name=[self.spec.name],
            dtype=self._dtype(),
            max_model_len=self.max_model_len,
            max_num_seqs=self.capacity,
            enforce_eager=True,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=int(self.kv_cache_gib * (1 << 30)),
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            generation_config="vllm",
            seed=0,
            disable_log_stats=False,
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[self._kv.logger])

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Piece, None]:
        """Stream one answer from a free slot (see the module notes)."""
        llm, slots = self._llm, self._slots
        if llm is None or slots is None:
            raise EngineError(f"engine {self.name} is not started")
        try:  # tokenized by vLLM's renderer (its raw-prompt path is deprecated), which
            # also processes a prompt's multi_modal_data (its images)
            source = await self._seeing(llm, request) if any(
                m.get("images") for m in request.messages) else self._prompt(llm, request)
            (prompt,) = await llm.renderer.render_cmpl_async([source])
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"vLLM refused the prompt: {exc}") from exc
        self._waiting += 1
        try:
            await slots.acquire()
        finally:
            self._waiting -= 1
        pieces = self._stream(llm, prompt, sampling_params(request),
                              f"{request.request_id}-{uuid.uuid4().hex[:8]}")
        try:
            if self._llm is None:  # closed while this generation waited for a slot
                raise EngineError("the generation was cancelled")
            async for piece in pieces:
                yield piece
        finally:
            await pieces.aclose()
            slots.release()

    async def _stream(self, llm: AsyncLLM, prompt: Any, params: SamplingParams,
                      rid: str) -> AsyncGenerator[Piece, None]:
        """vLLM's deltas as pieces; an end before the last one aborts ``rid``."""
        self._live.add(rid)
        finished = False
        stream = llm.generate(prompt, params, rid)
        try:
            carried = 0
            prompt_tokens = 0
            logprobs: list[TokenLogprob] = []
            async for out in stream:
                completion = out.outputs[0]
                carried += len(completion.token_ids)
                prompt_tokens = prompt_tokens or len(out.prompt_token_ids or ())
                if params.logprobs is not None:
                    logprobs.extend(delta_logprobs(completion, params.logprobs))
                if not out.finished:
                    if completion.text:
                        yield Piece(completion.text, tokens=carried, logprobs=tuple(logprobs))
                        carried = 0
                        logprobs.clear()
                    continue
                finished = True
                reason = completion.finish_reason
                if reason not in ("stop", "length"):
                    raise EngineError("the generation was cancelled" if reason == "abort"
                                      else f"vLLM ended the generation: {reason}")
                if reason == "stop" and completion.stop_reason is None and logprobs:
                    logprobs.pop()  # the end of the answer's token, which OpenAI leaves out
                yield Piece(completion.text, tokens=carried,
                            finish_reason="length" if reason == "length" else "stop",
                            prompt_tokens=prompt_tokens, cached_tokens=out.num_cached_tokens or 0,
                            logprobs=tuple(logprobs))
                return
            raise EngineError("vLLM ended the stream without a finish reason")
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"vLLM failed: {exc}") from exc
        finally:
            self._live.discard(rid)
            if not finished:  # closed, cancelled or failed: free the sequence now
                with contextlib.suppress(Exception):
                    await llm.abort(rid)
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _prompt(self, llm: AsyncLLM, request: GenerationRequest) -> dict[str, Any]:
        text = request.rendered
        if text is None:
            try:
                rendered = llm.get_tokenizer().apply_chat_template(
                    request.chat(), tokenize=False, add_generation_prompt=True)
            except Exception as exc:
                raise EngineError(f"{self.spec.name}: cannot render the chat: {exc}") from exc
            text = str(rendered) + request.continuation
        prompt: dict[str, Any] = (
            {"prompt": text} if text else {"prompt_token_ids": list(self._bos)})
        if request.cache_salt:  # vLLM refuses an empty one
            prompt["cache_salt"] = request.cache_salt
        return prompt

    async def _seeing(self, llm: AsyncLLM, request: GenerationRequest) -> dict[str, Any]:
        """A chat with images, in vLLM's multimodal form: the prompt the model's
        chat template renders from content parts (``{"type": "image"}`` where each
        image stood), and the images, decoded off the event loop (each stream
        of the worker goes on meanwhile), in ``multi_modal_data``."""
        chat: list[dict[str, Any]] = []
        data: list[bytes] = []
        for m in request.messages:
            parts: list[dict[str, Any]] = []
            for part in message_parts(m, request.images):
                if isinstance(part, str):
                    parts.append({"type": "text", "text": part})
                else:
                    parts.append({"type": "image"})
                    data.append(part.data)
            chat.append({"role": m["role"], "content": parts})
        images = await asyncio.to_thread(_decoded, data)
        try:
            rendered = llm.get_tokenizer().apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise EngineError(f"{self.spec.name}: cannot render the chat with its images: "
                              f"{exc}") from exc
        prompt: dict[str, Any] = {"prompt": str(rendered) + request.continuation,
                                  "multi_modal_data": {"image": images}}
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        return prompt

    def kv_state(self) -> KvCache | None:
        return self._kv.state()

    async def close(self) -> None:
        """Abort what runs (its consumers get an EngineError), stop vLLM."""
        llm, self._llm, slots, self._slots = self._llm, None, self._slots, None
        if llm is None or slots is None:
            return
        for _ in range(self._waiting):  # wake the waiting: they find the engine closed
            slots.release()
        live = list(self._live)
        if live:
            with contextlib.suppress(Exception):
                await llm.abort(live)
            await asyncio.sleep(0)  # the aborted streams see their end first
        # vLLM's shutdown stops the engine core before it cancels the task that reads
        # the core's outputs, which then logs the dead core as a failure ("AsyncLLM
        # output_handler failed."): cancelled here first, on its own loop
        handler = getattr(llm, "output_handler", None)
        if isinstance(handler, asyncio.Task):
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await handler
        await asyncio.to_thread(llm.shutdown)
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.terminate()
            await asyncio.to_thread(watch.wait)


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _watch(pids: set[int]) -> subprocess.Popen[bytes] | None:
    """A watch that ends vLLM's processes ``pids`` if this process dies first."""
    if not pids:
        return None
    return subprocess.Popen([sys.executable, "-m", "workers.infer.engines.vllm_watch",
                             str(os.getpid()), *(str(p) for p in sorted(pids))])


def sampling_params(request: GenerationRequest) -> SamplingParams:
    """vLLM's ``SamplingParams`` of a request (OpenAI's and vLLM's mean the same)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=max(0.0, request.temperature),
        top_p=request.top_p if 0 < request.top_p <= 1 else 1.0,
        seed=request.seed,
        stop=list(request.stop) or None,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=dict(request.logit_bias) or None,
        logprobs=request.top_logprobs if request.logprobs else None,
        max_tokens=max(1, request.max_tokens),
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=structured_outputs(request),
    )


def delta_logprobs(completion: Any, top: int) -> list[TokenLogprob]:
    """vLLM's log probabilities of the tokens a delta output added: the sampled
    token's, and the ``top`` most likely by rank."""
    out: list[TokenLogprob] = []
    for token, entries in zip(completion.token_ids, completion.logprobs or (), strict=False):
        chosen = entries[token]
        ranked = sorted(((t, e) for t, e in entries.items()
                         if e.rank is not None and e.rank <= top), key=lambda te: te[1].rank)
        best = [TopLogprob(token=e.decoded_token or "", bytes=(e.decoded_token or "").encode(),
                           logprob=float(e.logprob)) for _, e in ranked]
        text = chosen.decoded_token or ""
        out.append(TokenLogprob(token=text, bytes=text.encode(), logprob=float(chosen.logprob),
                                top=best))
    return out


def structured_outputs(request: GenerationRequest) -> Any:
    """vLLM's ``StructuredOutputsParams`` of the request, or None for free text."""
    fmt = request.response_format
    if fmt is None:
        return None
    if request.continuation:
        raise EngineError("vLLM cannot continue a structured answer another run began: "
                          "its structured outputs start at the schema's beginning")
    from vllm.sampling_params import StructuredOutputsParams

    if fmt["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt["type"] == "tool_calls":  # the tools' GBNF, which xgrammar reads as well
        return StructuredOutputsParams(grammar=grammar_of(fmt))
    return StructuredOutputsParams(json=json.loads(fmt["schema"]))


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

    def state(self) -> KvCache | None:
        if self.usage is None or not self.total_blocks:
            return None
        free = self.total_blocks - round(self.usage * self.total_blocks)
        return KvCache(usage=self.usage, total_blocks=self.total_blocks, free_blocks=free,
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


def _decoded(data: list[bytes]) -> list[Any]:
    """Each image's bytes decoded to the RGB picture vLLM's processor takes."""
    from PIL import Image

    return [Image.open(io.BytesIO(d)).convert("RGB") for d in data]
