"""Does the default model answer what its weights say? Greedy agreement of
each GGUF precision with a float32 reference.

    .venv/bin/python -m bench.reference [--precisions source,q8_0,f16,f32] [--json PATH]

Every prompt of ``infra.reference_prompts`` runs greedily (its first
``--tokens``) through Conveyor's llama.cpp engine once per precision, chat
prompts rendered as preprocess renders them; the reference is the same
weights dequantized to float32 and run by transformers in a child process
under ``.venv-vllm``, fed the very token ids llama.cpp evaluates. Where two
texts differ, the table says after how many tokens they part. Why f16 is the
default: docs/decisions/0008-default-model-precision.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, get_args

from bench.engines import engine_stream
from bench.harness import repo_root
from conveyor.registry import ModelSpec, Precision, Registry
from infra.reference_prompts import PROMPTS, ReferencePrompt
from schemas.records import Message

__all__ = ["Agreement", "main"]

REFERENCE_PYTHON = repo_root() / ".venv-vllm" / "bin" / "python"
MODELS, MODEL = repo_root() / "conveyor" / "models.toml", "smollm2"  # the default model


@dataclass
class Agreement:
    """One engine and precision against the reference."""

    side: str
    agreed: list[str] = field(default_factory=list)
    # prompt id -> tokens the two answers share before they part
    disagreed: dict[str, int] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)


# -- the llama.cpp side (this process) ----------------------------------------------


async def _answer(engine: Any, prompt: ReferencePrompt, text: str, max_tokens: int) -> str:
    stream = engine_stream(engine, prompt.kind)
    return "".join([piece async for piece, _ in stream(text, max_tokens)])


def _rendered(spec: ModelSpec) -> dict[str, str]:
    """Each prompt's text as preprocess hands it to the engine."""
    from workers.preprocess.tokenizers import GgufTokenizer

    tokenizer = GgufTokenizer(spec.source_gguf_path())
    out = {}
    for p in PROMPTS:
        rendered = (tokenizer.render_chat([Message(role=m["role"], content=m["content"])
                                           for m in p.messages])
                    if p.kind == "chat" else p.prompt)
        if rendered is None:
            raise SystemExit(f"{spec.name} has no chat template")
        out[p.id] = rendered
    return out


# -- the reference (a child process with torch) --------------------------------------


async def _reference(ids: dict[str, list[int]], tokens: int, python: Path) -> dict[str, list[int]]:
    child = await asyncio.create_subprocess_exec(
        str(python), "-m", "bench.reference", "--child", "--tokens", str(tokens),
        cwd=str(repo_root()),
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await child.communicate(json.dumps(ids).encode())
    if child.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-8:]
        raise SystemExit("the float32 reference failed:\n  " + "\n  ".join(tail))
    answer: dict[str, list[int]] = json.loads(out)
    return answer


def _child(tokens: int) -> int:
    """Greedy continuations in float32 by transformers for the ids on stdin."""
    import torch
    from transformers import AutoModelForCausalLM

    from workers.infer.engines.vllm_weights import prepare

    torch.set_num_threads(1)  # beside one llama.cpp thread on a shared machine
    spec = replace(Registry.load(MODELS).resolve(MODEL), precision="source")
    directory = prepare(spec)  # the packaged file dequantized, as vLLM reads it
    llm = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    llm.eval()
    eos = llm.generation_config.eos_token_id
    out: dict[str, list[int]] = {}
    with torch.inference_mode():
        for key, ids in json.load(sys.stdin).items():
            prompt = torch.tensor([ids])
            made = llm.generate(prompt, attention_mask=torch.ones_like(prompt),
                                max_new_tokens=tokens, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos)
            out[key] = [int(t) for t in made[0, len(ids):]]
    print(json.dumps(out))
    return 0


# -- comparing ---------------------------------------------------------------------


def _compare(side: str, answers: dict[str, str], reference: dict[str, str],
             reference_ids: dict[str, list[int]], vocab: Any) -> Agreement:
    result = Agreement(side, texts=answers)
    for key, text in answers.items():
        if text == reference[key]:
            result.agreed.append(key)
            continue
        ours = vocab.tokenize(text.encode(), add_bos=False, special=False)
        result.disagreed[key] = len(os.path.commonprefix([ours, reference_ids[key]]))
    return result


def _decoded(vocab: Any, ids: list[int]) -> str:
    eos = vocab.token_eos()
    if eos in ids:
        ids = ids[:ids.index(eos)]
    return str(vocab.detokenize(ids).decode("utf-8", errors="replace"))


# -- the run -----------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from llama_cpp import Llama

    from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine

    spec = Registry.load(MODELS).resolve(MODEL)
    precisions: list[Precision] = [spec.precision if p == "default" else p
                                   for p in args.precisions.split(",")]
    vocab = Llama(model_path=str(spec.source_gguf_path()), vocab_only=True, verbose=False)
    rendered = _rendered(spec)
    ids = {k: vocab.tokenize(t.encode(), add_bos=False, special=True) if t
           else [vocab.token_bos()] for k, t in rendered.items()}
    reference_task = asyncio.create_task(_reference(ids, args.tokens, args.reference_python))
    engines: dict[str, Any] = {}
    answers: dict[str, dict[str, str]] = {}
    try:
        for precision in dict.fromkeys(precisions):
            # the worker's defaults: two sequences, each in a batched context of its own
            engine = LlamaCppBatchEngine.from_spec(replace(spec, precision=precision),
                                                   sequences=2, contexts=2)
            await engine.start()
            engines[precision] = engine
            answers[precision] = {p.id: await _answer(engine, p, rendered[p.id], args.tokens)
                                  for p in PROMPTS}
        reference_ids = await reference_task
        reference = {k: _decoded(vocab, v) for k, v in reference_ids.items()}
    finally:
        reference_task.cancel()
        for engine in engines.values():
            await engine.close()
    agreements = [_compare(f"llama.cpp {p}", answers[p], reference, reference_ids, vocab)
                  for p in answers]
    source_file = spec.source_gguf_path().name
    return {"model": spec.name, "source_file": source_file, "default": spec.precision,
            "tokens": args.tokens, "reference": reference,
            "agreement": {a.side.removeprefix("llama.cpp "): asdict(a) for a in agreements},
            "readme": [p.id for p in PROMPTS if p.readme]}


def report(result: dict[str, Any]) -> str:
    total = len(result["reference"])
    lines = [f"{result['model']} ({result['source_file']}), greedy, first {result['tokens']} "
             "tokens, against transformers float32 on the same weights:", "",
             "| engine / precision | agreed | disagree (tokens shared before they part) |",
             "|---|---|---|",
             f"| transformers float32 (the reference) | {total} of {total} | |"]
    for precision, a in result["agreement"].items():
        parted = ", ".join(f"{k} ({n})" for k, n in a["disagreed"].items()) or "none"
        mark = " (default)" if precision == result["default"] else ""
        lines.append(f"| llama.cpp {precision}{mark} | {len(a['agreed'])} of {total} | "
                     f"{parted} |")
    lines += ["", "The README's examples, greedy:"]
    for key in result["readme"]:
        lines.append(f"  {key}: reference {result['reference'][key]!r}")
        for precision, a in result["agreement"].items():
            lines.append(f"  {' ' * len(key)}  llama.cpp {precision}: {a['texts'][key]!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reference",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", default=",".join(get_args(Precision)),
                        help="comma-separated; 'default' is the registry's (default: all)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--reference-python", type=Path, default=REFERENCE_PYTHON)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.tokens)
    for precision in args.precisions.split(","):
        if precision != "default" and precision not in get_args(Precision):
            parser.error(f"unknown precision {precision!r}")
    result = asyncio.run(run(args))
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
