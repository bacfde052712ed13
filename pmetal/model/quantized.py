"""The quantized engine: a decoder whose weights stay in their GGUF blocks.

What it owns: :class:`QuantizedWeights` (a stage's matrices as
:class:`~pmetal.model.kernels.QMatrix` views, usually of a memory-mapped
GGUF file, plus the small float32 vectors: norms, biases) and
:class:`QuantizedStage`, which runs layers ``[start, end)`` on them with the
fused kernels of :mod:`pmetal.model.kernels`. No float32 copy of a whole
matrix is ever made: a product dequantizes inside its dot products, an
embedding lookup dequantizes only the rows it takes.

Why this shape:

* Memory. A 4-bit model expanded to float32 needs 7-8x its file; a home
  cluster runs a model split across machines precisely because it does not
  fit, so the blocks stay as they are and the map's pages are the file's
  (shared with the page cache, dropped under pressure, never swapped).
* Speed. Decode reads every weight once per token: the time is the bytes
  read, and 4-bit blocks are an eighth of float32's.
* Fusion without copies. q, k and v (and gate and up) are three matrices in
  the file; one kernel call takes all of them in one threaded dispatch, so
  they need no fused copy.
* Rotary layout. GGUF files of Llama (and Mistral) store q and k rows
  permuted for the interleaved rotary convention, Qwen's keep Hugging
  Face's rows; this engine keeps the rows where the file has them and
  rotates in the layout it is told (``QuantizedWeights.rotary``,
  :mod:`pmetal.model.ops`).
* Qwen. q, k and v biases (Qwen2) are added after their products; each q
  and k head is RMS-normalised (Qwen3) before it is rotated, as Hugging
  Face's Qwen3 does.

Bits: every row of a product depends only on that row's input and the
weights (the kernels' promise), and everything else is row-wise or
per-sequence, so a sequence's tokens are the same alone, in a batch of any
composition, on any thread count and over any split into stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pmetal.errors import PMetalValueError
from pmetal.model import kernels
from pmetal.model.cache import KVCache
from pmetal.model.config import LlamaConfig
from pmetal.model.kernels import QMatrix
from pmetal.model.ops import ROTARY_LAYOUTS, Rotary, attend, rms_norm, silu

__all__ = ["QuantizedLayer", "QuantizedStage", "QuantizedWeights"]

F32 = np.float32


@dataclass(frozen=True)
class QuantizedLayer:
    """One decoder layer: projections ``(out, in)`` in their blocks, norms
    and biases float32."""

    attn_norm: np.ndarray
    wq: QMatrix
    wk: QMatrix
    wv: QMatrix
    wo: QMatrix
    mlp_norm: np.ndarray
    w_gate: QMatrix
    w_up: QMatrix
    w_down: QMatrix
    q_bias: np.ndarray | None = None   # Qwen2
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None   # Qwen3: (head_dim,)
    k_norm: np.ndarray | None = None

    def matrices(self) -> tuple[QMatrix, ...]:
        return (self.wq, self.wk, self.wv, self.wo, self.w_gate, self.w_up, self.w_down)

    def check(self, config: LlamaConfig, index: int) -> None:
        h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
        shapes = {"wq": (config.q_size, h), "wk": (config.kv_size, h), "wv": (config.kv_size, h),
                  "wo": (h, config.q_size), "w_gate": (i, h), "w_up": (i, h), "w_down": (h, i)}
        for name, shape in shapes.items():
            matrix = getattr(self, name)
            if (matrix.rows, matrix.cols) != shape:
                raise PMetalValueError(f"layer {index} {name}: expected {shape}, got "
                                       f"{(matrix.rows, matrix.cols)}")
        vectors = {"attn_norm": (h, True), "mlp_norm": (h, True),
                   "q_bias": (config.q_size, config.attention_bias),
                   "k_bias": (config.kv_size, config.attention_bias),
                   "v_bias": (config.kv_size, config.attention_bias),
                   "q_norm": (hd, config.qk_norm), "k_norm": (hd, config.qk_norm)}
        for name, (size, wanted) in vectors.items():
            vector = getattr(self, name)
            if wanted and (vector is None or vector.shape != (size,) or vector.dtype != F32):
                raise PMetalValueError(
                    f"layer {index} {name}: expected float32 ({size},), got "
                    f"{None if vector is None else (vector.dtype, vector.shape)}")
            if not wanted and vector is not None:
                raise PMetalValueError(f"layer {index} has {name}, which a "
                                       f"{config.architecture} model does not use")


@dataclass(frozen=True)
class QuantizedWeights:
    """Layers ``[start, start + len(layers))`` of a model, plus the
    embedding when ``start == 0`` and the final norm and LM head when the
    range ends at the last layer (``lm_head`` may be the embedding: tied).
    ``rotary`` says how q and k rows are laid out; ``keepalive`` holds
    whatever the matrices view (an open GGUF file) for as long as they live."""

    config: LlamaConfig
    start: int
    layers: tuple[QuantizedLayer, ...]
    embed_tokens: QMatrix | None = None
    norm: np.ndarray | None = None
    lm_head: QMatrix | None = None
    rotary: str = "half"
    keepalive: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        c = self.config
        if not self.layers:
            raise PMetalValueError("a stage needs at least one layer")
        if not 0 <= self.start < self.end <= c.num_hidden_layers:
            raise PMetalValueError(f"layers [{self.start}, {self.end}) do not fit a model of "
                                   f"{c.num_hidden_layers} layers")
        if self.rotary not in ROTARY_LAYOUTS:
            raise PMetalValueError(f"rotary {self.rotary!r}: choose from "
                                   f"{', '.join(ROTARY_LAYOUTS)}")
        for offset, layer in enumerate(self.layers):
            layer.check(c, self.start + offset)
        table = (c.vocab_size, c.hidden_size)
        for name, present, shape in (("embed_tokens", self.is_first, table),
                                     ("lm_head", self.is_last, table)):
            matrix = getattr(self, name)
            if present and (matrix is None or (matrix.rows, matrix.cols) != shape):
                raise PMetalValueError(
                    f"{name}: layers [{self.start}, {self.end}) need a {shape} matrix, got "
                    f"{None if matrix is None else (matrix.rows, matrix.cols)}")
        if self.is_last and (self.norm is None or self.norm.shape != (c.hidden_size,)):
            raise PMetalValueError(f"the last stage needs the final norm ({c.hidden_size},)")

    @classmethod
    def from_float(cls, weights: Any, ggml_type: int = kernels.Q8_0) -> QuantizedWeights:
        """Float32 weights (a :class:`~pmetal.pipeline.llama.LlamaWeights`,
        Hugging Face layout) quantized to ``ggml_type`` blocks with the
        ``gguf`` package: random test models for this engine. ``F32``
        keeps the float32 arrays (as bytes, not copied): the MLX engine's
        float models."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        kind = GGMLQuantizationType(ggml_type)

        def q(matrix: np.ndarray) -> QMatrix:
            rows, cols = matrix.shape
            blocks = np.ascontiguousarray(quantize(matrix, kind)).view(np.uint8)
            return QMatrix(blocks.reshape(rows, -1), ggml_type, rows, cols)

        layers = tuple(
            QuantizedLayer(attn_norm=w.attn_norm, mlp_norm=w.mlp_norm, wq=q(w.wq), wk=q(w.wk),
                           wv=q(w.wv), wo=q(w.wo), w_gate=q(w.w_gate), w_up=q(w.w_up),
                           w_down=q(w.w_down), q_bias=w.q_bias, k_bias=w.k_bias,
                           v_bias=w.v_bias, q_norm=w.q_norm, k_norm=w.k_norm)
            for w in weights.layers)
        embed = None if weights.embed_tokens is None else q(weights.embed_tokens)
        head = None
        if weights.lm_head is not None:
            head = embed if weights.lm_head is weights.embed_tokens and embed is not None \
                else q(weights.lm_head)
        return cls(config=weights.config, start=weights.start, layers=layers,
                   embed_tokens=embed, norm=weights.norm, lm_head=head, rotary="half")

    @property
    def end(self) -> int:
        return self.start + len(self.layers)

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.config.num_hidden_layers

    @property
    def nbytes(self) -> int:
        """Bytes of the stage's tensors as stored (a tied head counted once)."""
        matrices = {id(m): m for layer in self.layers for m in layer.matrices()}
        for m in (self.embed_tokens, self.lm_head):
            if m is not None:
                matrices[id(m)] = m
        vectors = sum(v.nbytes for layer in self.layers
                      for v in (layer.attn_norm, layer.mlp_norm, layer.q_bias, layer.k_bias,
                                layer.v_bias, layer.q_norm, layer.k_norm) if v is not None)
        return sum(m.nbytes for m in matrices.values()) + vectors + (
            0 if self.norm is None else self.norm.nbytes)


class QuantizedStage:
    """Runs layers ``[weights.start, weights.end)`` on hidden states with
    the fused quantized kernels; the interface of the reference
    :class:`~pmetal.pipeline.llama.LlamaStage` (``embed``, ``forward``,
    ``forward_batch``, ``logits``, ``new_cache``, ``rest``, ``close``).

    Products run on the process's compute threads
    (:func:`pmetal.pipeline.threads.compute_threads`, read through the
    ``threads`` callable), at most ``max_threads``; any count gives the same
    bits. The kernels' thread pool sleeps by itself between products, so
    :meth:`rest` and :meth:`close` have nothing to stop."""

    helpers = None
    helper_pids: list[int] = []

    def __init__(self, weights: QuantizedWeights, *, max_threads: int | None = None,
                 threads: Any = None) -> None:
        if max_threads is not None and (isinstance(max_threads, bool)
                                        or not isinstance(max_threads, int) or max_threads < 1):
            raise PMetalValueError(f"max_threads must be a positive integer, got {max_threads!r}")
        c = self.config = weights.config
        self.weights = weights
        self.start, self.end = weights.start, weights.end
        self._max_threads = max_threads
        self._threads = threads
        self._eps = F32(c.rms_norm_eps)
        self._scale = F32(1.0 / math.sqrt(c.head_dim))
        self._rotate = Rotary(c, weights.rotary)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def rest(self) -> None:
        """Nothing to do: the kernels' threads sleep by themselves."""

    def close(self) -> None:
        """Nothing to end: the kernels' thread pool is the process's."""

    def _thread_count(self) -> int:
        count = (self._threads() if self._threads is not None else 0) or 1
        return count if self._max_threads is None else min(count, self._max_threads)

    def _mul(self, x: np.ndarray, *weights: QMatrix) -> list[np.ndarray]:
        # Every product, a prompt's too, runs on the fused kernels: a
        # dequantized tile on numpy's GEMM was faster for long prompts on
        # an idle machine (512 tokens: 1.3 against 2.2-2.5 s) but
        # OpenBLAS's spinning threads made a 16-token prompt take 1-4 s
        # beside two busy processes (0.2 s on the kernels), and its buffers
        # cost 88 MB.
        return kernels.matmul(np.ascontiguousarray(x, dtype=F32), weights,
                              threads=self._thread_count())

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache for one sequence of at most ``max_len`` tokens
        (default: the model's max_position_embeddings)."""
        return KVCache(self.config, self.num_layers,
                       self.config.max_position_embeddings if max_len is None else max_len)

    def embed(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Hidden states ``(T, hidden)`` of token ids (first stage only)."""
        table = self.weights.embed_tokens
        if table is None or not self.weights.is_first:
            raise PMetalValueError(
                f"stage [{self.start}, {self.end}) is not the first stage: it has no embedding")
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise PMetalValueError(
                f"token ids must be in 0..{self.config.vocab_size - 1}, got {ids.min()}..{ids.max()}")
        return kernels.take_rows(table, ids)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits ``(T, vocab)`` after the final norm (last stage only)."""
        w = self.weights
        if w.lm_head is None or w.norm is None or not w.is_last:
            raise PMetalValueError(
                f"stage [{self.start}, {self.end}) is not the last stage: it has no LM head")
        return self._mul(rms_norm(self._as_hidden(hidden), w.norm, self._eps), w.lm_head)[0]

    def _as_hidden(self, hidden: np.ndarray) -> np.ndarray:
        if hidden.dtype != F32 or hidden.ndim != 2 or hidden.shape[1] != self.config.hidden_size:
            raise PMetalValueError(
                f"hidden states must be float32 (T, {self.config.hidden_size}), got "
                f"{hidden.dtype} {hidden.shape}")
        return hidden

    def _qkv(self, layer: QuantizedLayer, x: np.ndarray, positions: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.config
        t = x.shape[0]
        q, k, v = self._mul(rms_norm(x, layer.attn_norm, self._eps), layer.wq, layer.wk, layer.wv)
        if layer.q_bias is not None:
            q += layer.q_bias
            k += layer.k_bias
            v += layer.v_bias
        q = q.reshape(t, c.num_attention_heads, c.head_dim)
        k = k.reshape(t, c.num_key_value_heads, c.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, self._eps)
            k = rms_norm(k, layer.k_norm, self._eps)
        return (self._rotate(q, positions), self._rotate(k, positions),
                v.reshape(t, c.num_key_value_heads, c.head_dim))

    def _mlp(self, layer: QuantizedLayer, x: np.ndarray) -> np.ndarray:
        gate, up = self._mul(rms_norm(x, layer.mlp_norm, self._eps), layer.w_gate, layer.w_up)
        return x + self._mul(silu(gate) * up, layer.w_down)[0]

    def forward(self, hidden: np.ndarray, cache: KVCache) -> np.ndarray:
        """Run this stage's layers on ``hidden`` (T, hidden), the next T
        tokens of the sequence whose cache this is; returns (T, hidden)."""
        x = self._as_hidden(hidden)
        t, first = x.shape[0], cache.length
        if first + t > cache.max_len:
            raise PMetalValueError(
                f"sequence would reach {first + t} tokens, beyond its KV cache of {cache.max_len}")
        positions = np.arange(first, first + t)
        for index, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, x, positions)
            cache.keys[index, :, first:first + t] = k.transpose(1, 0, 2)
            cache.values[index, :, first:first + t] = v.transpose(1, 0, 2)
            attn = attend(self.config, q, cache.keys[index, :, :first + t],
                          cache.values[index, :, :first + t], first, self._scale)
            x = x + self._mul(attn, layer.wo)[0]
            x = self._mlp(layer, x)
        cache.length = first + t
        return x

    def forward_batch(self, hidden: np.ndarray, caches: Sequence[KVCache]) -> np.ndarray:
        """One decode token for each of ``len(caches)`` sequences: ``hidden``
        (B, hidden), row i the next token of the sequence of ``caches[i]``,
        which may all be at different positions."""
        x = self._as_hidden(hidden)
        if x.shape[0] != len(caches):
            raise PMetalValueError(f"{x.shape[0]} hidden rows for {len(caches)} caches")
        if len({id(cache) for cache in caches}) != len(caches):
            raise PMetalValueError("a sequence appears twice in one batch")
        for cache in caches:
            if cache.length + 1 > cache.max_len:
                raise PMetalValueError(
                    f"sequence would exceed its KV cache of {cache.max_len} tokens")
        positions = np.array([cache.length for cache in caches])
        for index, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, x, positions)
            attn = np.empty((len(caches), self.config.q_size), dtype=F32)
            for row, cache in enumerate(caches):
                pos = cache.length
                cache.keys[index, :, pos] = k[row]
                cache.values[index, :, pos] = v[row]
                attn[row] = attend(self.config, q[row:row + 1], cache.keys[index, :, :pos + 1],
                                   cache.values[index, :, :pos + 1], pos, self._scale)[0]
            x = x + self._mul(attn, layer.wo)[0]
            x = self._mlp(layer, x)
        for cache in caches:
            cache.length += 1
        return x
