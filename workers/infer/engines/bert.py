"""A BERT encoder's forward pass in numpy, and sentence embeddings from it.

Token ids in, one unit-length vector per input out: the encoder's last hidden
states pooled over each input's tokens (the mean, or the [CLS] state, as the
model's pooling config says), then L2-normalised, as sentence-transformers
computes them. Float32 throughout; the matrix products go to numpy's BLAS.
Inputs are sorted by length and run in batches of similar lengths, so little
of a batch is padding (docs/decisions/0034-embeddings.md measured this engine
against torch, vLLM and llama.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from conveyor.encoder_files import EncoderConfig, EncoderFiles, locate_weights

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HfTokenizer

__all__ = ["BertEncoder", "load_encoder"]

# a batch holds at most this many tokens (padding included), or one input: its
# arrays stay a few MB (measured: 512 embeds 1.4x what 4096 did, whose 25 MB
# arrays are fresh pages at every step)
_BATCH_TOKENS = 512


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's GELU, the exact one (not the tanh approximation): x/2 (1 + erf(x/sqrt 2)),
    erf to 1.5e-7 (Abramowitz and Stegun 7.1.26; numpy has no erf), computed in
    place over as few arrays as it can (each a pass over memory)."""
    f32 = np.float32
    z = x * f32(0.7071067811865476)
    a = np.abs(z)
    t = a * f32(0.3275911)
    t += 1
    np.reciprocal(t, out=t)
    p = t * f32(1.061405429)
    for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        p += f32(c)
        p *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    p *= a  # 1 - erf(|z|)
    np.subtract(1, p, out=p)
    np.sign(z, out=z)
    p *= z  # erf(z)
    p += 1
    p *= x
    p *= f32(0.5)
    return p


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(-1, keepdims=True)
    return centred / np.sqrt(var + np.float32(eps)) * weight + bias


@dataclass(frozen=True)
class _Layer:
    qkv: np.ndarray  # (hidden, 3 * hidden), transposed for x @ w
    qkv_bias: np.ndarray
    out: np.ndarray
    out_bias: np.ndarray
    norm1: tuple[np.ndarray, np.ndarray]
    up: np.ndarray
    up_bias: np.ndarray
    down: np.ndarray
    down_bias: np.ndarray
    norm2: tuple[np.ndarray, np.ndarray]


class BertEncoder:
    """A BERT model's weights (as ``model.safetensors`` names them) and its
    forward pass, which keeps no state: calls may run side by side."""

    def __init__(self, config: EncoderConfig, weights: dict[str, np.ndarray]) -> None:
        self.config = config
        w = {k.removeprefix("bert."): v for k, v in weights.items()}
        self.words = w["embeddings.word_embeddings.weight"]
        self.positions = w["embeddings.position_embeddings.weight"]
        self.token_type = w["embeddings.token_type_embeddings.weight"][0]
        self.embed_norm = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self.layers = [self._layer(w, f"encoder.layer.{i}.") for i in range(config.layers)]

    @staticmethod
    def _layer(w: dict[str, np.ndarray], p: str) -> _Layer:
        att = p + "attention."
        qkv = np.concatenate([w[f"{att}self.{n}.weight"] for n in ("query", "key", "value")])
        qkv_bias = np.concatenate([w[f"{att}self.{n}.bias"] for n in ("query", "key", "value")])
        return _Layer(
            qkv=np.ascontiguousarray(qkv.T), qkv_bias=qkv_bias,
            out=np.ascontiguousarray(w[f"{att}output.dense.weight"].T),
            out_bias=w[f"{att}output.dense.bias"],
            norm1=(w[f"{att}output.LayerNorm.weight"], w[f"{att}output.LayerNorm.bias"]),
            up=np.ascontiguousarray(w[f"{p}intermediate.dense.weight"].T),
            up_bias=w[f"{p}intermediate.dense.bias"],
            down=np.ascontiguousarray(w[f"{p}output.dense.weight"].T),
            down_bias=w[f"{p}output.dense.bias"],
            norm2=(w[f"{p}output.LayerNorm.weight"], w[f"{p}output.LayerNorm.bias"]))

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One unit vector per input (token ids with [CLS] and [SEP] in place),
        as an ``(inputs, dimensions)`` float32 array in the inputs' order."""
        out = np.zeros((len(inputs), self.dimensions), np.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and \
                    len(inputs[order[end]]) * (end + 1 - start) <= _BATCH_TOKENS:
                end += 1
            batch = order[start:end]
            out[batch] = self._batch([inputs[i] for i in batch])
            start = end
        return out

    def _batch(self, inputs: list[list[int]]) -> np.ndarray:
        cfg = self.config
        length = max(len(ids) for ids in inputs)
        if length > cfg.max_positions:
            raise ValueError(f"an input of {length} tokens is longer than the model's "
                             f"{cfg.max_positions} positions")
        ids = np.zeros((len(inputs), length), np.int64)
        mask = np.zeros((len(inputs), length), np.float32)
        for row, seq in enumerate(inputs):
            ids[row, :len(seq)] = seq
            mask[row, :len(seq)] = 1.0
        x = self.words[ids] + self.positions[:length] + self.token_type
        x = _layer_norm(x, *self.embed_norm, cfg.layer_norm_eps)
        # padding is never attended to
        bias = ((1.0 - mask) * np.float32(-1e4))[:, None, None, :]
        for layer in self.layers:
            x = self._layer_forward(x, layer, bias)
        if cfg.pooling == "cls":
            pooled = x[:, 0]
        else:
            pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        return pooled / np.maximum(norms, np.float32(1e-12))

    def _layer_forward(self, x: np.ndarray, layer: _Layer, bias: np.ndarray) -> np.ndarray:
        cfg = self.config
        batch, length, hidden = x.shape
        heads, size = cfg.heads, hidden // cfg.heads
        flat = x.reshape(batch * length, hidden)  # one large product, not one per input
        qkv = flat @ layer.qkv + layer.qkv_bias
        qkv = qkv.reshape(batch, length, 3, heads, size).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each (batch, heads, length, size)
        scores = (q @ k.transpose(0, 1, 3, 2)) * np.float32(1.0 / np.sqrt(size)) + bias
        scores -= scores.max(-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(-1, keepdims=True)
        context = (scores @ v).transpose(0, 2, 1, 3).reshape(batch * length, hidden)
        flat = _layer_norm(context @ layer.out + layer.out_bias + flat, *layer.norm1,
                           cfg.layer_norm_eps)
        inner = _gelu(flat @ layer.up + layer.up_bias)
        flat = _layer_norm(inner @ layer.down + layer.down_bias + flat, *layer.norm2,
                           cfg.layer_norm_eps)
        return flat.reshape(batch, length, hidden)


def load_encoder(weights: str, threads: int) -> tuple[BertEncoder, HfTokenizer]:
    """The encoder and tokenizer of the model files ``weights`` names (a
    ``package:`` reference or a path), numpy's BLAS held to ``threads`` for the
    process: on cores another process uses, a thread a core runs ten times
    slower than one."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(threads, user_api="blas")
    files = EncoderFiles(locate_weights(weights))
    return BertEncoder(files.config(), files.weights()), files.tokenizer()
