"""The float32 numpy pieces of a decoder layer that are not weight products,
shared by the reference and the quantized engines.

Everything stays float32: one float64 operand makes numpy promote and copy
(a 10x slowdown was once seen from float64 rotary tables).

Rotary embeddings come in two layouts of the same arithmetic:

* ``half``: Hugging Face's "rotate half", each head's first half against its
  second half;
* ``interleaved``: adjacent pairs, as llama.cpp's converter stores Llama's q
  and k rows in a GGUF file (``LlamaModel.permute``). An engine that keeps
  those rows where the file has them rotates this way; attention scores are
  the same, since q and k share the permutation within each head and v is
  not permuted.
"""

from __future__ import annotations

import numpy as np

from pmetal.errors import PMetalValueError
from pmetal.model.config import LlamaConfig

__all__ = ["ROTARY_LAYOUTS", "Rotary", "attend", "rms_norm", "silu"]

F32 = np.float32
ROTARY_LAYOUTS = ("half", "interleaved")


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """RMSNorm over the last axis, scaled by ``weight``."""
    # np.mean's bits (a sum, then a division by the count) without its
    # Python-level bookkeeping: 60 calls a token.
    variance = np.square(x).sum(axis=-1, keepdims=True) / F32(x.shape[-1])
    return x * (F32(1.0) / np.sqrt(variance + eps)) * weight


def silu(x: np.ndarray) -> np.ndarray:
    # sigmoid via tanh: no overflow warning for very negative inputs, unlike exp(-x)
    return x * (F32(0.5) + F32(0.5) * np.tanh(F32(0.5) * x))


class Rotary:
    """Rotary embedding tables of one model, in one layout."""

    def __init__(self, config: LlamaConfig, layout: str = "half") -> None:
        if layout not in ROTARY_LAYOUTS:
            raise PMetalValueError(f"rotary layout {layout!r}: choose from "
                                   f"{', '.join(ROTARY_LAYOUTS)}")
        self.layout = layout
        self.half = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (
            np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim))
        angles = np.outer(np.arange(config.max_position_embeddings, dtype=np.float64), inv_freq)
        self.cos = np.cos(angles).astype(F32)  # (max_pos, head_dim / 2)
        self.sin = np.sin(angles).astype(F32)
        # Interleaved pairs are complex numbers: one multiply rotates them all.
        self.cis = (self.cos + 1j * self.sin).astype(np.complex64) \
            if layout == "interleaved" else None

    def __call__(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``x`` (T, heads, head_dim) rotated for ``positions`` (T,)."""
        if self.cis is not None:
            pairs = np.ascontiguousarray(x).view(np.complex64)
            return (pairs * self.cis[positions][:, None, :]).view(F32)
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x[..., :self.half], x[..., self.half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attend(config: LlamaConfig, q: np.ndarray, keys: np.ndarray, values: np.ndarray,
           first: int, scale: np.float32) -> np.ndarray:
    """Causal grouped-query attention of queries ``q`` (T, heads, hd) at
    positions first..first+T-1 over ``keys``/``values`` (kv_heads, first+T,
    hd). Returns (T, q_size)."""
    kv_heads, hd = config.num_key_value_heads, config.head_dim
    group = config.num_attention_heads // kv_heads
    t = q.shape[0]
    # (kv_heads, group * T, hd): the heads sharing one key-value head side by side
    qg = q.reshape(t, kv_heads, group, hd).transpose(1, 2, 0, 3).reshape(kv_heads, group * t, hd)
    scores = np.matmul(qg, keys.transpose(0, 2, 1))
    scores *= scale
    if t > 1:
        # Adding 0 leaves a score's bits as they are; -inf hides a future key.
        span = keys.shape[1]
        row = np.tile(np.arange(first, first + t), group)
        scores += np.where(np.arange(span)[None, :] > row[:, None], F32(-np.inf), F32(0.0))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, values)  # (kv_heads, group * T, hd)
    return out.reshape(kv_heads, group, t, hd).transpose(2, 0, 1, 3).reshape(t, config.q_size)
