"""The model registry: names, aliases, context length, pool and tokenizer.

Loaded from a TOML file (``models.toml`` beside this module by default, or
``Settings.models_file``). Route resolves a request's model through it,
preprocess learns the context window and tokenizer, infer workers find the
weights.
"""

from __future__ import annotations

import importlib.util
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from conveyor.errors import ConveyorError, ModelNotFound

__all__ = ["ModelSpec", "Registry", "locate_gguf"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    pool: str
    context_length: int
    default_max_tokens: int = 256
    tokenizer: Literal["gguf", "estimate"] = "estimate"
    gguf: str | None = None
    upstream_model: str | None = None  # the name an HTTP upstream knows it by
    aliases: tuple[str, ...] = field(default_factory=tuple)

    def gguf_path(self) -> Path:
        if not self.gguf:
            raise ConveyorError(f"model {self.name} has no gguf file")
        return locate_gguf(self.gguf)


def locate_gguf(ref: str) -> Path:
    """``package:NAME`` -> the first .gguf inside that installed package (found
    without importing it); anything else is a path."""
    if not ref.startswith("package:"):
        return Path(ref)
    spec = importlib.util.find_spec(ref.removeprefix("package:"))
    if spec is None or not spec.submodule_search_locations:
        raise ConveyorError(f"{ref}: the package is not installed")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob("*.gguf"))
        if found:
            return found[0]
    raise ConveyorError(f"{ref}: no .gguf file inside the package")


def _spec(name: str, entry: dict[str, object]) -> ModelSpec:
    try:
        tokenizer = str(entry.get("tokenizer", "estimate"))
        if tokenizer not in ("gguf", "estimate"):
            raise ValueError(f"tokenizer must be gguf or estimate, not {tokenizer!r}")
        aliases = entry.get("aliases", ())
        if not isinstance(aliases, list | tuple):
            raise ValueError("aliases must be a list of names")
        spec = ModelSpec(
            name=name,
            pool=str(entry["pool"]),
            context_length=int(entry["context_length"]),  # type: ignore[call-overload]
            default_max_tokens=int(entry.get("default_max_tokens", 256)),  # type: ignore[call-overload]
            tokenizer=tokenizer,  # type: ignore[arg-type]
            gguf=str(entry["gguf"]) if entry.get("gguf") else None,
            upstream_model=str(entry["upstream_model"]) if entry.get("upstream_model")
            else None,
            aliases=tuple(str(a) for a in aliases),
        )
    except KeyError as exc:
        raise ConveyorError(f"model `{name}` has no `{exc.args[0]}`") from None
    except (TypeError, ValueError) as exc:
        raise ConveyorError(f"model `{name}`: {exc}") from None
    if spec.context_length <= 0 or spec.default_max_tokens <= 0:
        raise ConveyorError(f"model `{name}`: context_length and default_max_tokens must be "
                            "positive")
    return spec


class Registry:
    def __init__(self, models: list[ModelSpec]) -> None:
        self.models = {m.name: m for m in models}
        self._names: dict[str, ModelSpec] = {}
        for m in models:
            for name in (m.name, *m.aliases):
                other = self._names.get(name)
                if other is not None and other is not m:
                    raise ConveyorError(f"the name `{name}` is given to both model "
                                        f"`{other.name}` and model `{m.name}`")
                self._names[name] = m

    @classmethod
    def load(cls, path: Path) -> Registry:
        """Read a registry file; a file that is not TOML, an entry without a
        required field or with a wrong value, and a name given to two models are
        refused with the file and the model named."""
        try:
            data = tomllib.loads(path.read_text())
            models = [_spec(name, entry) for name, entry in data.get("models", {}).items()]
            return cls(models)
        except (OSError, tomllib.TOMLDecodeError, ConveyorError) as exc:
            raise ConveyorError(f"{path}: {exc}") from exc

    def find(self, name: str) -> ModelSpec | None:
        return self._names.get(name)

    def resolve(self, name: str) -> ModelSpec:
        spec = self._names.get(name)
        if spec is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        return spec

    def pools(self) -> tuple[str, ...]:
        return tuple(sorted({m.pool for m in self.models.values()}))
