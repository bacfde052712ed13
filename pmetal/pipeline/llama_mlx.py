"""The Llama-family decoder of :mod:`pmetal.pipeline.llama` in MLX, for Apple
silicon, and the choice between the two.

:class:`MlxLlamaStage` has the interface of
:class:`~pmetal.pipeline.llama.LlamaStage` (``embed``, ``forward``,
``forward_batch``, ``logits``, ``new_cache``) and takes the same
:class:`~pmetal.pipeline.llama.LlamaWeights`; hidden states go in and out
as float32 numpy arrays, so that the activation codec and the stage actors
do not care which backend computed them. Inside, everything is an MLX
array on MLX's default device (the GPU on a Mac), using MLX's fused
kernels: ``mx.fast.rms_norm``, ``mx.fast.rope`` (``traditional=False``:
Hugging Face's rotate-half convention, as the numpy decoder) and
``mx.fast.scaled_dot_product_attention`` (grouped-query attention without
repeating the key-value heads). Qwen2's q/k/v biases are added after the
fused product, Qwen3's per-head q/k norms are ``mx.fast.rms_norm`` over
each head before the rotary embedding, as in the numpy decoder.

The two backends agree to float32 rounding, not bit for bit: a pipeline
whose stages mix backends does not promise the single-process greedy
output. :mod:`pmetal.pipeline.backends` picks one backend for every stage.

``mlx`` is imported only when an MLX stage is built. On Linux (``mlx[cpu]``)
its matrix products are ~30x slower than numpy's OpenBLAS: ``auto``
therefore means MLX only on macOS on Apple silicon.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np

from pmetal.errors import PMetalValueError
from pmetal.pipeline.llama import LlamaConfig, LlamaWeights

__all__ = ["MlxKVCache", "MlxLlamaStage", "mlx_available"]


def mlx_available() -> bool:
    """Whether ``mlx`` can be imported here."""
    return importlib.util.find_spec("mlx") is not None


class MlxKVCache:
    """Keys and values of one sequence for one MLX stage's layers: per
    layer an MLX array ``(kv_heads, length, head_dim)`` that grows by
    concatenation (MLX arrays are not updated in place), up to ``max_len``
    positions."""

    def __init__(self, config: LlamaConfig, num_layers: int, max_len: int) -> None:
        if max_len <= 0 or max_len > config.max_position_embeddings:
            raise PMetalValueError(
                f"KV cache length {max_len} must be in 1..{config.max_position_embeddings} "
                "(the model's max_position_embeddings)")
        self.keys: list[Any] = [None] * num_layers
        self.values: list[Any] = [None] * num_layers
        self.max_len = max_len
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.keys, *self.values) if a is not None)

    def reset(self) -> None:
        """Forget the sequence."""
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self.length = 0


class MlxLlamaStage:
    """Runs layers ``[weights.start, weights.end)`` in MLX; see
    :class:`~pmetal.pipeline.llama.LlamaStage` for the interface."""

    def __init__(self, weights: LlamaWeights) -> None:
        import mlx.core as mx
        if not weights.layers:
            raise PMetalValueError("a stage needs at least one layer")
        self._mx = mx
        c = self.config = weights.config
        self.start, self.end = weights.start, weights.end
        self._eps = float(c.rms_norm_eps)
        self._scale = 1.0 / float(np.sqrt(c.head_dim))
        a = lambda x: mx.array(np.ascontiguousarray(x, dtype=np.float32))
        layers = weights.layers
        self._attn_norm = [a(w.attn_norm) for w in layers]
        self._mlp_norm = [a(w.mlp_norm) for w in layers]
        self._wqkv = [a(np.concatenate([w.wq, w.wk, w.wv])) for w in layers]
        self._qkv_bias = [None if w.q_bias is None else
                          a(np.concatenate([w.q_bias, w.k_bias, w.v_bias])) for w in layers]
        self._q_norm = [None if w.q_norm is None else a(w.q_norm) for w in layers]
        self._k_norm = [None if w.k_norm is None else a(w.k_norm) for w in layers]
        self._wo = [a(w.wo) for w in layers]
        self._wgu = [a(np.concatenate([w.w_gate, w.w_up])) for w in layers]
        self._wdown = [a(w.w_down) for w in layers]
        self._embed = None if weights.embed_tokens is None else a(weights.embed_tokens)
        self._norm = None if weights.norm is None else a(weights.norm)
        self._head = None if weights.lm_head is None else (
            self._embed if weights.lm_head is weights.embed_tokens else a(weights.lm_head))
        mx.eval(self._wqkv, self._wo, self._wgu, self._wdown)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def rest(self) -> None:
        """Nothing spins between steps here (see :meth:`LlamaStage.rest`)."""

    def close(self) -> None:
        """Nothing to end (see :meth:`LlamaStage.close`)."""

    def new_cache(self, max_len: int | None = None) -> MlxKVCache:
        return MlxKVCache(self.config, self.num_layers,
                          self.config.max_position_embeddings if max_len is None else max_len)

    def embed(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Hidden states ``(T, hidden)`` of token ids (first stage only)."""
        if self._embed is None:
            raise PMetalValueError(
                f"stage [{self.start}, {self.end}) is not the first stage: it has no embedding")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise PMetalValueError(
                f"token ids must be in 0..{self.config.vocab_size - 1}, got {ids.min()}..{ids.max()}")
        return np.array(self._embed[self._mx.array(ids.astype(np.int32))])

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits ``(T, vocab)`` after the final norm (last stage only)."""
        if self._head is None or self._norm is None:
            raise PMetalValueError(
                f"stage [{self.start}, {self.end}) is not the last stage: it has no LM head")
        mx = self._mx
        x = mx.fast.rms_norm(self._as_hidden(hidden), self._norm, self._eps)
        return np.array(x @ self._head.T)

    def _as_hidden(self, hidden: np.ndarray) -> Any:
        if hidden.dtype != np.float32 or hidden.ndim != 2 \
                or hidden.shape[1] != self.config.hidden_size:
            raise PMetalValueError(
                f"hidden states must be float32 (T, {self.config.hidden_size}), got "
                f"{hidden.dtype} {hidden.shape}")
        return self._mx.array(hidden)

    def _attention(self, layer: int, qkv: Any, cache: MlxKVCache) -> Any:
        """One sequence's attention: ``qkv`` (T, q+2kv) of its next T tokens;
        appends their keys and values to its cache; returns (T, q_size)."""
        mx, c = self._mx, self.config
        t, first = qkv.shape[0], cache.length
        hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q = qkv[:, :c.q_size].reshape(t, nh, hd).transpose(1, 0, 2)[None]
        k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(t, nkv, hd).transpose(1, 0, 2)[None]
        v = qkv[:, c.q_size + c.kv_size:].reshape(t, nkv, hd).transpose(1, 0, 2)[None]
        if self._q_norm[layer] is not None:
            q = mx.fast.rms_norm(q, self._q_norm[layer], self._eps)
            k = mx.fast.rms_norm(k, self._k_norm[layer], self._eps)
        q = mx.fast.rope(q, hd, traditional=False, base=float(c.rope_theta), scale=1.0,
                         offset=first)
        k = mx.fast.rope(k, hd, traditional=False, base=float(c.rope_theta), scale=1.0,
                         offset=first)
        if cache.keys[layer] is not None:
            k = mx.concatenate([cache.keys[layer], k], axis=2)
            v = mx.concatenate([cache.values[layer], v], axis=2)
        cache.keys[layer], cache.values[layer] = k, v
        mask = None
        if t > 1:  # causal, offset by what the cache held: query i sees keys 0..first+i
            mask = mx.arange(first + t)[None, :] <= (mx.arange(t) + first)[:, None]
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self._scale, mask=mask)
        return out[0].transpose(1, 0, 2).reshape(t, c.q_size)

    def _layer_rest(self, layer: int, x: Any, attn: Any) -> Any:
        mx, inter = self._mx, self.config.intermediate_size
        x = x + attn @ self._wo[layer].T
        gu = mx.fast.rms_norm(x, self._mlp_norm[layer], self._eps) @ self._wgu[layer].T
        gate, up = gu[:, :inter], gu[:, inter:]
        return x + (gate * mx.sigmoid(gate) * up) @ self._wdown[layer].T

    def _qkv(self, layer: int, x: Any) -> Any:
        qkv = self._mx.fast.rms_norm(x, self._attn_norm[layer], self._eps) @ self._wqkv[layer].T
        return qkv if self._qkv_bias[layer] is None else qkv + self._qkv_bias[layer]

    def forward(self, hidden: np.ndarray, cache: MlxKVCache) -> np.ndarray:
        """Run this stage's layers on ``hidden`` (T, hidden), the next T
        tokens of the sequence whose cache this is; returns (T, hidden)."""
        x = self._as_hidden(hidden)
        t = x.shape[0]
        if cache.length + t > cache.max_len:
            raise PMetalValueError(
                f"sequence would reach {cache.length + t} tokens, beyond its KV cache of "
                f"{cache.max_len}")
        for layer in range(self.num_layers):
            x = self._layer_rest(layer, x, self._attention(layer, self._qkv(layer, x), cache))
        self._mx.eval(x, cache.keys, cache.values)  # keep the graphs short
        cache.length += t
        return np.array(x)

    def forward_batch(self, hidden: np.ndarray, caches: Sequence[MlxKVCache]) -> np.ndarray:
        """One decode token for each of ``len(caches)`` sequences (row i the
        next token of ``caches[i]``'s sequence); projections run once for the
        batch, attention per sequence."""
        mx = self._mx
        x = self._as_hidden(hidden)
        if x.shape[0] != len(caches):
            raise PMetalValueError(f"{x.shape[0]} hidden rows for {len(caches)} caches")
        if len({id(cache) for cache in caches}) != len(caches):
            raise PMetalValueError("a sequence appears twice in one batch")
        for cache in caches:
            if cache.length + 1 > cache.max_len:
                raise PMetalValueError(
                    f"sequence would exceed its KV cache of {cache.max_len} tokens")
        for layer in range(self.num_layers):
            qkv = self._qkv(layer, x)
            attn = mx.concatenate([self._attention(layer, qkv[i:i + 1], cache)
                                   for i, cache in enumerate(caches)])
            x = self._layer_rest(layer, x, attn)
        mx.eval(x, [c.keys for c in caches], [c.values for c in caches])
        for cache in caches:
            cache.length += 1
        return np.array(x)
