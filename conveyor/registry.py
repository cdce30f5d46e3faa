"""The model registry: names, aliases, context length, pool, tokenizer,
fallbacks and canaries, loaded from a TOML file (``models.toml`` beside this
module, or ``models_file``). A model's ``precision`` names the GGUF its
engines load (:func:`precise_gguf`). Format: docs/operating/registry.md; why
f16 by default: docs/decisions/0008-default-model-precision.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import hashlib
import importlib.util
import logging
import os
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, get_args

from conveyor.errors import ConveyorError, ModelNotFound

__all__ = ["DEFAULT_FLOOR", "MeaningRoute", "ModelKind", "ModelSpec", "Precision", "Registry",
           "file_digest", "locate_gguf",
           "locate_packaged",
           "model_cache",
           "precise_gguf"]

Precision = Literal["source", "q8_0", "f16", "f32"]
# what a model serves: generations (chat and completions) or embeddings
ModelKind = Literal["generation", "embedding"]

log = logging.getLogger(__name__)

# the confidence below which a routed alias's default answers
DEFAULT_FLOOR = 0.6


@dataclass(frozen=True)
class MeaningRoute:
    """One route of an alias that routes by the prompt's meaning: the model it
    names, and the example prompts and keywords a prompt is scored against
    (workers/route/meaning.py)."""

    name: str
    model: str
    examples: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    pool: str
    context_length: int
    default_max_tokens: int = 256
    tokenizer: Literal["gguf", "estimate", "hf"] = "estimate"
    gguf: str | None = None
    kind: ModelKind = "generation"
    # an encoder's files (conveyor/encoder_files.py): "package:NAME" or a path; an
    # embedding model behind an HTTP upstream (upstream_model) has none
    weights: str | None = None
    # an embedding model's vector width (the gateway refuses another before submitting)
    dimensions: int | None = None
    upstream_model: str | None = None  # the name an HTTP upstream knows it by
    aliases: tuple[str, ...] = field(default_factory=tuple)
    precision: Precision = "source"
    # the models (names or aliases) a request for this one goes to, in order,
    # when this one's pool cannot take it (no live worker, every breaker open)
    fallbacks: tuple[str, ...] = field(default_factory=tuple)
    # a canary: the registry's models that serve requests for this name, with
    # integer weights; a tenant always gets the same one (Registry.deployment)
    deployments: tuple[tuple[str, int], ...] = field(default_factory=tuple)
    # an alias that routes by meaning: its routes, the model below the floor,
    # the floor, and the embedding model that scores examples ("": keywords only)
    routes: tuple[MeaningRoute, ...] = field(default_factory=tuple)
    default: str = ""
    floor: float = DEFAULT_FLOOR
    encoder: str = ""

    @property
    def serves_itself(self) -> bool:
        """A model, not a canary or an alias routed by meaning."""
        return not self.deployments and not self.routes
    # it reads image parts of messages (docs/api/chat.md#images); a request with
    # images for a model that does not is refused, naming the first image part
    vision: bool = False

    def source_gguf_path(self) -> Path:
        """The GGUF file as ``gguf`` names it (packaged, or a path)."""
        if not self.gguf:
            raise ConveyorError(f"model {self.name} has no gguf file")
        return locate_gguf(self.gguf)

    def gguf_path(self) -> Path:
        """The GGUF file at the model's ``precision``: the source file, or the one
        converted from it (converted now, once, when it is not there yet)."""
        return precise_gguf(self.source_gguf_path(), self.precision, prefix=self.name)


def locate_packaged(ref: str, pattern: str) -> Path:
    """``package:NAME`` -> the first file matching ``pattern`` inside that
    installed package (found without importing it: a model's package is its
    files); anything else is a path."""
    if not ref.startswith("package:"):
        return Path(ref)
    spec = importlib.util.find_spec(ref.removeprefix("package:"))
    if spec is None or not spec.submodule_search_locations:
        raise ConveyorError(f"{ref}: the package is not installed")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob(pattern))
        if found:
            return found[0]
    raise ConveyorError(f"{ref}: no {pattern} inside the package")


def locate_gguf(ref: str) -> Path:
    """The GGUF a model's ``gguf`` names (:func:`locate_packaged`)."""
    return locate_packaged(ref, "*.gguf")


def model_cache() -> Path:
    """Where converted weights are kept: ``CONVEYOR_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/conveyor/models`` (``~/.cache/conveyor/models``), the
    directory the vLLM engine's converted weights share."""
    explicit = os.environ.get("CONVEYOR_MODEL_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "conveyor" / "models"


def precise_gguf(source: Path, precision: Precision, prefix: str = "model",
                 cache: Path | None = None, lock_timeout_s: float = 120.0) -> Path:
    """``source`` at ``precision``, converted once with llama.cpp's own
    converter (it keeps the tokenizer and chat template) and kept in
    :func:`model_cache` under a name keyed on the source's content; written
    beside its name and renamed, and converted by one process at a time (a lock
    file, waited for at most ``lock_timeout_s``)."""
    if precision == "source":
        return source
    target_dir = cache or model_cache()
    target = target_dir / f"{prefix}-{file_digest(source)}.{precision}.gguf"
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with (target_dir / f"{target.name}.lock").open("w") as lock:
        if not _lock(lock, target, lock_timeout_s):
            raise ConveyorError(f"{target}: another process has held its lock for "
                                f"{lock_timeout_s:.0f} s without finishing the conversion")
        if not target.exists():
            _convert(source, target, precision)
    return target


def file_digest(path: Path) -> str:
    """The first 12 hex digits of the file's sha256: what converted files are keyed on."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()[:12]


def _lock(lock: IO[str], target: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    waiting = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if not waiting:
                log.info("waiting (at most %.0f s) for another process converting %s",
                         timeout_s, target.name)
                waiting = True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "f16": "LLAMA_FTYPE_MOSTLY_F16",
           "f32": "LLAMA_FTYPE_ALL_F32"}


def _convert(source: Path, target: Path, precision: Precision) -> None:
    try:
        import llama_cpp
    except ImportError as exc:
        raise ConveyorError(f"converting {source.name} to {precision} needs "
                            "llama-cpp-python") from exc
    log.info("converting %s to %s once: %s", source.name, precision, target)
    started = time.monotonic()
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, _FTYPES[precision])
    params.allow_requantize = True  # the source may be quantized already
    params.nthread = 1
    # llama.cpp logs every tensor it converts: at INFO, which this hides
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    try:
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(staging).encode(),
                                                ctypes.byref(params))
        if failed:
            raise ConveyorError(f"converting {source} to {precision} failed "
                                f"(llama.cpp returned {failed})")
        staging.rename(target)
    finally:
        staging.unlink(missing_ok=True)
    log.info("converted %s to %s in %.1f s", source.name, precision, time.monotonic() - started)


# every field an entry may have, and what it must be (said when it is not)
_FIELDS: dict[str, str] = {
    "pool": "a pool name (text)",
    "context_length": "a positive integer (tokens)",
    "default_max_tokens": "a positive integer (tokens)",
    "tokenizer": 'one of "gguf", "estimate", "hf"',
    "gguf": 'a path or "package:NAME" (text)',
    "kind": 'one of "generation", "embedding"',
    "dimensions": "a positive integer (an embedding model's vector width)",
    "weights": 'an encoder\'s model.zip or directory: a path or "package:NAME" (text)',
    "upstream_model": "a model name (text)",
    "aliases": "a list of names (text)",
    "precision": "one of " + ", ".join(f'"{p}"' for p in get_args(Precision)),
    "fallbacks": "a list of model names (text)",
    "deployments": "a table of model = weight (a positive integer)",
    "routes": "a table of route = { model, examples, keywords }",
    "default": "the model (text) a prompt goes to when no route is confident",
    "floor": "a confidence from 0 to 1 (a number)",
    "encoder": "an embedding model of the registry (text)",
    "vision": "true or false (the model reads image parts of messages)",
}
_ROUTE_FIELDS = ("model", "examples", "keywords")


class _Entry:
    """One model's table, read field by field: every wrong field is noted (with
    what it must be) and reading goes on, so a file's faults are told at once."""

    def __init__(self, name: str, entry: dict[str, object]) -> None:
        self.name, self.entry = name, entry
        self.faults: list[str] = [f"model `{name}`: unknown field `{key}` (fields: "
                       f"{', '.join(_FIELDS)})" for key in entry if key not in _FIELDS]

    def wrong(self, key: str, value: object, why: str | None = None) -> None:
        self.faults.append(f"model `{self.name}`: {why or f'{key} must be {_FIELDS[key]}'}"
                           f", not {value!r}")

    def text(self, key: str, default: str | None = None) -> str | None:
        value = self.entry.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str):
            self.wrong(key, value)
            return default
        return value

    def choice(self, key: str, default: str) -> str:
        value = self.entry.get(key, default)
        if value not in _choices(key):
            self.wrong(key, value)
            return default
        return str(value)

    def tokens(self, key: str, default: int) -> int:
        value = self.entry.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            self.wrong(key, value)
            return default
        return value

    def flag(self, key: str) -> bool:
        value = self.entry.get(key, False)
        if not isinstance(value, bool):
            self.wrong(key, value)
            return False
        return value

    def names(self, key: str) -> tuple[str, ...]:
        value = self.entry.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.wrong(key, value)
            return ()
        return tuple(value)

    def deployments(self) -> tuple[tuple[str, int], ...]:
        value = self.entry.get("deployments", {})
        if not isinstance(value, dict):
            self.wrong("deployments", value)
            return ()
        out = []
        for model, weight in value.items():
            if not isinstance(weight, int) or isinstance(weight, bool) or weight <= 0:
                self.wrong("deployments", weight, f"the weight of deployment `{model}` must "
                                                  "be a positive integer")
            else:
                out.append((str(model), weight))
        return tuple(out)

    def routes(self) -> tuple[MeaningRoute, ...]:
        value = self.entry.get("routes", {})
        if not isinstance(value, dict) or not all(isinstance(r, dict) for r in value.values()):
            self.wrong("routes", value)
            return ()
        out = []
        for name, route in value.items():
            where = f"route `{name}`"
            unknown = [k for k in route if k not in _ROUTE_FIELDS]
            if unknown:
                self.faults.append(f"model `{self.name}`: {where} has an unknown field "
                                   f"`{unknown[0]}` (fields: {', '.join(_ROUTE_FIELDS)})")
            model = route.get("model")
            lists = {k: route.get(k, []) for k in ("examples", "keywords")}
            if not isinstance(model, str) or not model:
                self.wrong("routes", model, f"{where} must name its model (text)")
                continue
            if not all(isinstance(v, list) and all(isinstance(t, str) and t.strip() for t in v)
                       for v in lists.values()):
                self.faults.append(f"model `{self.name}`: {where}'s examples and keywords "
                                   "must be lists of non-empty text")
                continue
            if not lists["examples"] and not lists["keywords"]:
                self.faults.append(f"model `{self.name}`: {where} needs examples or keywords")
                continue
            out.append(MeaningRoute(str(name), model, tuple(lists["examples"]),
                                    tuple(k.strip().lower() for k in lists["keywords"])))
        return tuple(out)

    def floor(self) -> float:
        value = self.entry.get("floor", DEFAULT_FLOOR)
        if not isinstance(value, int | float) or isinstance(value, bool) \
                or not 0 <= value <= 1:
            self.wrong("floor", value)
            return DEFAULT_FLOOR
        return float(value)

    def required(self, key: str) -> None:
        if key not in self.entry:
            self.faults.append(f"model `{self.name}` has no `{key}` ({_FIELDS[key]})")


def _choices(key: str) -> tuple[str, ...]:
    if key == "kind":
        return get_args(ModelKind)
    return get_args(Precision) if key == "precision" else ("gguf", "estimate", "hf")


def _spec(entry: _Entry) -> ModelSpec:
    """The model an entry names; ``entry.faults`` holds what is wrong with it
    (the spec returned then is not to be served)."""
    deployments = entry.deployments()
    routes = entry.routes()
    if routes and deployments:
        entry.faults.append(f"model `{entry.name}`: routes and deployments do not go together")
    if "routes" in entry.entry and not entry.entry.get("default"):
        entry.required("default")
    if "routes" in entry.entry and not routes and not entry.faults:
        entry.faults.append(f"model `{entry.name}`: routes is empty")
    if not deployments and "deployments" not in entry.entry and "routes" not in entry.entry:
        entry.required("pool")
        entry.required("context_length")
    gguf = entry.text("gguf")
    precision = entry.choice("precision", "source")
    if precision != "source" and not gguf:
        entry.faults.append(f"model `{entry.name}`: precision {precision} needs a gguf file "
                            "to convert")
    kind = entry.choice("kind", "generation")
    weights = entry.text("weights")
    tokenizer = entry.choice("tokenizer", "estimate")
    if tokenizer == "hf" and not weights:
        entry.faults.append(f"model `{entry.name}`: tokenizer hf reads the tokenizer.json "
                            "of its `weights`")
    return ModelSpec(
        name=entry.name,
        pool=entry.text("pool", "") or "",
        context_length=entry.tokens("context_length", 1),
        default_max_tokens=entry.tokens("default_max_tokens", 256),
        tokenizer=tokenizer,  # type: ignore[arg-type]
        gguf=gguf or None,
        kind=kind,  # type: ignore[arg-type]
        weights=weights or None,
        dimensions=entry.tokens("dimensions", 1) if "dimensions" in entry.entry else None,
        upstream_model=entry.text("upstream_model") or None,
        aliases=entry.names("aliases"),
        precision=precision,  # type: ignore[arg-type]
        fallbacks=entry.names("fallbacks"),
        deployments=deployments,
        routes=routes,
        default=entry.text("default") or "",
        floor=entry.floor(),
        encoder=entry.text("encoder") or "",
        vision=entry.flag("vision"),
    )


class Registry:
    def __init__(self, models: list[ModelSpec]) -> None:
        # the applied registry it serves by (topics/models.py); None: its file's
        self.digest: str | None = None
        self.models = {m.name: m for m in models}
        self._names: dict[str, ModelSpec] = {}
        for m in models:
            for name in (m.name, *m.aliases):
                other = self._names.get(name)
                if other is not None and other is not m:
                    raise ConveyorError(f"the name `{name}` is given to both model "
                                        f"`{other.name}` and model `{m.name}`")
                self._names[name] = m
        for m in models:
            for fallback in m.fallbacks:
                target = self._names.get(fallback)
                if target is None:
                    raise ConveyorError(f"model `{m.name}`: its fallback `{fallback}` is not "
                                        "a model of the registry")
                if target is m:
                    raise ConveyorError(f"model `{m.name}`: it cannot be its own fallback")
                if target.routes:
                    raise ConveyorError(f"model `{m.name}`: its fallback `{fallback}` routes "
                                        "by meaning; name a model that serves itself")
            for deployment, _ in m.deployments:
                target = self._names.get(deployment)
                if target is None or not target.serves_itself:
                    raise ConveyorError(f"model `{m.name}`: its deployment `{deployment}` is "
                                        "not a model of the registry that serves itself")
                if target.name != deployment:
                    raise ConveyorError(f"model `{m.name}`: name its deployment "
                                        f"`{target.name}`, not its alias `{deployment}`")
        for m in models:
            if m.routes:
                self._check_routes(m)
        # a canary's limits, then a routed alias's: those all its models keep
        for m in [m for m in models if m.deployments] + [m for m in models if m.routes]:
            serving = [self.models[d] for d, _ in m.deployments] or [
                self._names[n] for n in (m.default, *(r.model for r in m.routes))]
            blind = [d.name for d in serving if m.vision and not d.vision]
            if blind:  # its images would reach a model that cannot read them
                raise ConveyorError(f"model `{m.name}` declares vision, but its model "
                                    f"`{blind[0]}` does not")
            limited = dataclasses.replace(
                m, context_length=min(d.context_length for d in serving),
                default_max_tokens=min(d.default_max_tokens for d in serving))
            self.models[m.name] = limited
            self._names.update({n: limited for n in (m.name, *m.aliases)})

    def _check_routes(self, m: ModelSpec) -> None:
        for name in (m.default, *(r.model for r in m.routes)):
            target = self._names.get(name)
            if target is None or target.routes or target.kind != "generation":
                raise ConveyorError(f"model `{m.name}`: its route model `{name}` is not a "
                                    "generation model of the registry that does not route "
                                    "by meaning itself")
        if m.encoder:
            encoder = self._names.get(m.encoder)
            if encoder is None or encoder.kind != "embedding" or not encoder.weights:
                raise ConveyorError(f"model `{m.name}`: its encoder `{m.encoder}` is not an "
                                    "embedding model of the registry with local weights")
        elif any(r.examples for r in m.routes):
            raise ConveyorError(f"model `{m.name}`: examples are scored by an encoder: name "
                                "one (an embedding model), or give keywords alone")

    def deployment(self, spec: ModelSpec, key: str) -> ModelSpec:
        """The model that serves a request for ``spec`` from ``key`` (its tenant):
        ``spec`` itself, or for a canary the deployment that a hash of the key
        and the name picks by weight, the same one for the same key every time."""
        if not spec.deployments:
            return spec
        digest = hashlib.blake2b(f"{spec.name}\0{key}".encode(), digest_size=8).digest()
        point = int.from_bytes(digest, "big") % sum(w for _, w in spec.deployments)
        for name, weight in spec.deployments:
            if point < weight:
                return self.models[name]
            point -= weight
        raise AssertionError("unreachable: the point falls within the total weight")

    def fallbacks(self, spec: ModelSpec) -> list[ModelSpec]:
        """The models ``spec`` falls back to, in order (resolved)."""
        return [self._names[f] for f in spec.fallbacks]

    @classmethod
    def load(cls, path: Path) -> Registry:
        """Read a registry file; a file that is not TOML, an entry without a
        required field or with a wrong value, and a name given to two models are
        refused with the file and the model named."""
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConveyorError(f"{path}: {exc}") from exc
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str) -> Registry:
        """A registry from the text of its file (``source`` names it in errors)."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConveyorError(f"{source}: {exc}") from exc
        tables = data.get("models", {})
        if not isinstance(tables, dict) or not all(isinstance(e, dict)
                                                   for e in tables.values()):
            raise ConveyorError(f"{source}: `models` must hold one table per model "
                                '([models."NAME"])')
        entries = [_Entry(str(name), entry) for name, entry in tables.items()]
        models = [_spec(entry) for entry in entries]
        faults = [fault for entry in entries for fault in entry.faults]
        if len(faults) == 1:
            raise ConveyorError(f"{source}: {faults[0]}")
        if faults:
            raise ConveyorError(f"{source}: {len(faults)} faults:\n  " + "\n  ".join(faults))
        try:
            return cls(models)
        except ConveyorError as exc:
            raise ConveyorError(f"{source}: {exc}") from exc

    def replace(self, other: Registry, digest: str | None) -> None:
        """Serve by ``other`` (applied as ``digest``) from now on. Everything
        that holds this registry (route, preprocess, the gateway, a worker) sees
        the change at once: a lookup reads one dictionary or the other."""
        self.models, self._names, self.digest = other.models, other._names, digest

    def find(self, name: str) -> ModelSpec | None:
        return self._names.get(name)

    def resolve(self, name: str) -> ModelSpec:
        spec = self._names.get(name)
        if spec is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return spec

    def pools(self) -> tuple[str, ...]:
        return tuple(sorted({m.pool for m in self.models.values() if m.serves_itself}))
