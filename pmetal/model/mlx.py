"""The MLX engine: a decoder whose weights stay quantized, in MLX's own form.

What it owns: :class:`MlxQuantizedStage`, which runs layers ``[start, end)``
of a :class:`~pmetal.model.quantized.QuantizedWeights` in MLX (the GPU on a
Mac), :class:`MlxMatrix` (one weight matrix, or several fused by rows, as
MLX arrays) and :class:`MlxKVCache`. It has the interface of
:class:`~pmetal.model.quantized.QuantizedStage` (``embed``, ``forward``,
``forward_batch``, ``logits``, ``new_cache``, ``rest``, ``close``); hidden
states go in and out as float32 numpy arrays, so the activation codec and
the stage actors do not care which backend computed them.

Weights. Each GGUF matrix is rewritten once, at load, one matrix at a time,
by :mod:`pmetal.model.mlxblocks`: the block formats with an exact MLX
equivalent (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K) become ``mx.quantized_matmul``
operands with the same values; Q6_K becomes float16; F16, BF16 and F32 stay
as they are. No float32 copy of a quantized matrix is ever held: an
embedding lookup dequantizes only the rows it takes.

Arithmetic. Activations are float32. A quantized product is
``mx.quantized_matmul`` on float32 input; a float16 or bfloat16 matrix
multiplies input rounded to its own type (MLX multiplies like types: mixing
would copy the whole matrix to float32 on every product), and its output is
float32 again. RMSNorm, rotary embeddings and attention are MLX's fused
kernels: ``mx.fast.rms_norm``, ``mx.fast.rope`` (``traditional=True``
rotates adjacent pairs, the layout of Llama's q and k rows in a GGUF file;
``False`` is Hugging Face's rotate-half) and
``mx.fast.scaled_dot_product_attention`` (grouped-query attention without
repeating the key-value heads).

Bits: MLX does not promise that a row's result is independent of the rows
beside it, so unlike the quantized engine this one agrees with itself over
batches and stage splits to float32 rounding, not bit for bit.

``mlx`` is imported only when a stage or matrix is built.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pmetal.errors import PMetalValueError
from pmetal.model.config import LlamaConfig
from pmetal.model.kernels import QMatrix
from pmetal.model.mlxblocks import GROUP, Affine, Dense, convert
from pmetal.model.quantized import QuantizedLayer, QuantizedWeights

__all__ = ["MlxKVCache", "MlxMatrix", "MlxQuantizedStage", "mlx_available"]


def mlx_available() -> bool:
    """Whether ``mlx`` can be imported here."""
    return importlib.util.find_spec("mlx") is not None


class MlxKVCache:
    """Keys and values of one sequence for one MLX stage's layers: per
    layer an MLX array ``(1, kv_heads, length, head_dim)`` that grows by
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


def _same_form(a: Affine | Dense, b: Affine | Dense) -> bool:
    if isinstance(a, Affine) and isinstance(b, Affine):
        return (a.bits, a.scales.dtype, a.cols) == (b.bits, b.scales.dtype, b.cols)
    if isinstance(a, Dense) and isinstance(b, Dense):
        return (a.array.dtype, a.bfloat16, a.cols) == (b.array.dtype, b.bfloat16, b.cols)
    return False


class MlxMatrix:
    """One or more matrices of the same form, stacked by rows in MLX
    arrays: ``w``/``scales``/``biases`` when quantized, else ``dense``
    (float16, bfloat16 or float32). ``sizes`` are the parts' row counts, so
    one product serves q, k and v (or gate and up) when their forms agree."""

    def __init__(self, parts: Sequence[Affine | Dense]) -> None:
        import mlx.core as mx

        first = parts[0]
        if not all(_same_form(first, part) for part in parts):
            raise PMetalValueError("only matrices of one form can be stacked")
        self.sizes = tuple(part.rows for part in parts)
        self.rows, self.cols = sum(self.sizes), first.cols

        def joined(name: str) -> Any:
            arrays = [getattr(part, name) for part in parts]
            return mx.array(arrays[0] if len(arrays) == 1 else np.concatenate(arrays))

        self.bits = first.bits if isinstance(first, Affine) else None
        if isinstance(first, Affine):
            self.w, self.scales, self.biases = joined("w"), joined("scales"), joined("biases")
            self.dense = None
        else:
            self.dense = joined("array")
            if first.bfloat16:
                self.dense = self.dense.view(mx.bfloat16)
        mx.eval(*self.arrays())

    def arrays(self) -> tuple[Any, ...]:
        return (self.dense,) if self.dense is not None else (self.w, self.scales, self.biases)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())

    def __call__(self, x: Any) -> Any:
        """``x @ self.T``, float32 ``(T, rows)`` of float32 ``x`` ``(T, cols)``."""
        import mlx.core as mx

        if self.dense is None:
            return mx.quantized_matmul(x, self.w, self.scales, self.biases, transpose=True,
                                       group_size=GROUP, bits=self.bits)
        if self.dense.dtype == mx.float32:
            return x @ self.dense.T
        return (x.astype(self.dense.dtype) @ self.dense.T).astype(mx.float32)

    def split(self, y: Any) -> list[Any]:
        """A product's columns, one array per stacked part."""
        import mlx.core as mx

        if len(self.sizes) == 1:
            return [y]
        return mx.split(y, np.cumsum(self.sizes)[:-1].tolist(), axis=-1)

    def take(self, ids: Any) -> Any:
        """Rows ``ids`` as float32, the only rows dequantized."""
        import mlx.core as mx

        if self.dense is not None:
            return self.dense[ids].astype(mx.float32)
        return mx.dequantize(self.w[ids], self.scales[ids].astype(mx.float32),
                             self.biases[ids].astype(mx.float32), group_size=GROUP,
                             bits=self.bits)


def _stack(matrices: Sequence[QMatrix]) -> tuple[MlxMatrix, ...]:
    """``matrices`` converted one at a time, neighbours of the same form
    stacked into one :class:`MlxMatrix`."""
    groups: list[list[Affine | Dense]] = []
    for matrix in matrices:
        part = convert(matrix)
        if groups and _same_form(groups[-1][0], part):
            groups[-1].append(part)
        else:
            groups.append([part])
    return tuple(MlxMatrix(group) for group in groups)


class _Layer:
    """One decoder layer's weights in MLX."""

    def __init__(self, layer: QuantizedLayer) -> None:
        import mlx.core as mx

        def vector(v: np.ndarray | None) -> Any:
            return None if v is None else mx.array(v)

        self.attn_norm, self.mlp_norm = vector(layer.attn_norm), vector(layer.mlp_norm)
        self.qkv = _stack((layer.wq, layer.wk, layer.wv))
        self.qkv_bias = None if layer.q_bias is None else mx.array(
            np.concatenate([layer.q_bias, layer.k_bias, layer.v_bias]))
        self.q_norm, self.k_norm = vector(layer.q_norm), vector(layer.k_norm)
        self.wo = _stack((layer.wo,))
        self.gate_up = _stack((layer.w_gate, layer.w_up))
        self.down = _stack((layer.w_down,))

    def matrices(self) -> Iterator[MlxMatrix]:
        yield from (*self.qkv, *self.wo, *self.gate_up, *self.down)


def _products(x: Any, matrices: Sequence[MlxMatrix]) -> list[Any]:
    return [part for matrix in matrices for part in matrix.split(matrix(x))]


class MlxQuantizedStage:
    """Runs layers ``[weights.start, weights.end)`` in MLX; see
    :class:`~pmetal.model.quantized.QuantizedStage` for the interface.
    Holds no reference to ``weights``: once built, the stage needs neither
    the blocks nor the file they view."""

    def __init__(self, weights: QuantizedWeights) -> None:
        import mlx.core as mx

        self._mx = mx
        c = self.config = weights.config
        self.start, self.end = weights.start, weights.end
        self._eps = float(c.rms_norm_eps)
        self._scale = 1.0 / float(np.sqrt(c.head_dim))
        self._traditional = weights.rotary == "interleaved"
        self._layers = [_Layer(layer) for layer in weights.layers]
        self._embed = None if weights.embed_tokens is None else _stack((weights.embed_tokens,))[0]
        self._norm = None if weights.norm is None else mx.array(weights.norm)
        self._head = None
        if weights.lm_head is not None:
            self._head = self._embed if weights.lm_head is weights.embed_tokens \
                else _stack((weights.lm_head,))[0]

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def matrices(self) -> Iterator[MlxMatrix]:
        """Every weight matrix the stage holds (a tied head once)."""
        for layer in self._layers:
            yield from layer.matrices()
        yield from (m for m in (self._embed, self._head if self._head is not self._embed else None)
                    if m is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of the stage's weights in MLX (matrices, norms, biases)."""
        vectors = [v for layer in self._layers
                   for v in (layer.attn_norm, layer.mlp_norm, layer.qkv_bias, layer.q_norm,
                             layer.k_norm) if v is not None]
        if self._norm is not None:
            vectors.append(self._norm)
        return sum(m.nbytes for m in self.matrices()) + sum(int(v.nbytes) for v in vectors)

    def rest(self) -> None:
        """Nothing spins between steps: MLX's work ends with each step."""

    def close(self) -> None:
        """Nothing to end: MLX's device and streams are the process's."""

    def new_cache(self, max_len: int | None = None) -> MlxKVCache:
        """An empty KV cache for one sequence of at most ``max_len`` tokens
        (default: the model's max_position_embeddings)."""
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
        return np.array(self._embed.take(self._mx.array(ids.astype(np.int32))))

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits ``(T, vocab)`` after the final norm (last stage only)."""
        if self._head is None or self._norm is None:
            raise PMetalValueError(
                f"stage [{self.start}, {self.end}) is not the last stage: it has no LM head")
        x = self._mx.fast.rms_norm(self._as_hidden(hidden), self._norm, self._eps)
        return np.array(self._head(x))

    def _as_hidden(self, hidden: np.ndarray) -> Any:
        if hidden.dtype != np.float32 or hidden.ndim != 2 \
                or hidden.shape[1] != self.config.hidden_size:
            raise PMetalValueError(
                f"hidden states must be float32 (T, {self.config.hidden_size}), got "
                f"{hidden.dtype} {hidden.shape}")
        return self._mx.array(hidden)

    def _qkv(self, layer: _Layer, x: Any) -> list[Any]:
        qkv = _products(self._mx.fast.rms_norm(x, layer.attn_norm, self._eps), layer.qkv)
        if layer.qkv_bias is None:
            return qkv
        c = self.config
        q, k, v = qkv
        bias = layer.qkv_bias
        return [q + bias[:c.q_size], k + bias[c.q_size:c.q_size + c.kv_size],
                v + bias[c.q_size + c.kv_size:]]

    def _attention(self, index: int, q: Any, k: Any, v: Any, cache: MlxKVCache) -> Any:
        """One sequence's attention: ``q``, ``k``, ``v`` (T, size) of its
        next T tokens; appends their keys and values to its cache; returns
        (T, q_size)."""
        mx, c, layer = self._mx, self.config, self._layers[index]
        t, first = q.shape[0], cache.length
        hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q = q.reshape(t, nh, hd).transpose(1, 0, 2)[None]
        k = k.reshape(t, nkv, hd).transpose(1, 0, 2)[None]
        v = v.reshape(t, nkv, hd).transpose(1, 0, 2)[None]
        if layer.q_norm is not None:
            q = mx.fast.rms_norm(q, layer.q_norm, self._eps)
            k = mx.fast.rms_norm(k, layer.k_norm, self._eps)
        rope = {"traditional": self._traditional, "base": float(c.rope_theta), "scale": 1.0,
                "offset": first}
        q, k = mx.fast.rope(q, hd, **rope), mx.fast.rope(k, hd, **rope)
        if cache.keys[index] is not None:
            k = mx.concatenate([cache.keys[index], k], axis=2)
            v = mx.concatenate([cache.values[index], v], axis=2)
        cache.keys[index], cache.values[index] = k, v
        mask = None
        if t > 1:  # causal, offset by what the cache held: query i sees keys 0..first+i
            mask = mx.arange(first + t)[None, :] <= (mx.arange(t) + first)[:, None]
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self._scale, mask=mask)
        return out[0].transpose(1, 0, 2).reshape(t, c.q_size)

    def _rest(self, layer: _Layer, x: Any, attn: Any) -> Any:
        mx = self._mx
        x = x + _products(attn, layer.wo)[0]
        gate, up = _products(mx.fast.rms_norm(x, layer.mlp_norm, self._eps), layer.gate_up)
        return x + _products(gate * mx.sigmoid(gate) * up, layer.down)[0]

    def forward(self, hidden: np.ndarray, cache: MlxKVCache) -> np.ndarray:
        """Run this stage's layers on ``hidden`` (T, hidden), the next T
        tokens of the sequence whose cache this is; returns (T, hidden)."""
        x = self._as_hidden(hidden)
        t = x.shape[0]
        if cache.length + t > cache.max_len:
            raise PMetalValueError(
                f"sequence would reach {cache.length + t} tokens, beyond its KV cache of "
                f"{cache.max_len}")
        for index, layer in enumerate(self._layers):
            q, k, v = self._qkv(layer, x)
            x = self._rest(layer, x, self._attention(index, q, k, v, cache))
        self._mx.eval(x, cache.keys, cache.values)  # keep the graphs short
        cache.length += t
        return np.array(x)

    def forward_batch(self, hidden: np.ndarray, caches: Sequence[MlxKVCache]) -> np.ndarray:
        """One decode token for each of ``len(caches)`` sequences (row i the
        next token of ``caches[i]``'s sequence); products run once for the
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
        for index, layer in enumerate(self._layers):
            q, k, v = self._qkv(layer, x)
            attn = mx.concatenate([
                self._attention(index, q[i:i + 1], k[i:i + 1], v[i:i + 1], cache)
                for i, cache in enumerate(caches)])
            x = self._rest(layer, x, attn)
        mx.eval(x, [c.keys for c in caches], [c.values for c in caches])
        for cache in caches:
            cache.length += 1
        return np.array(x)
