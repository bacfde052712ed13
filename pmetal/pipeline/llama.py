"""A Llama-architecture decoder in float32 numpy that runs any contiguous
range of its layers.

What it owns: the arithmetic of one pipeline stage (RMSNorm, rotary
embeddings, grouped-query attention with a per-sequence KV cache, SwiGLU),
plus the token embedding on the first stage and the final norm and LM head on
the last. It knows nothing of actors, sockets or files: loaders (Hugging Face
folders, GGUF) build a :class:`LlamaWeights`, the stage actor feeds hidden
states in and out.

Layouts, chosen for speed on a CPU:

* every projection is stored ``(out, in)``, C-contiguous, as Hugging Face
  stores it, so a slice of output rows is contiguous; decode products run
  as small GEMMs over such slices, shared with the stage's compute helpers
  (:mod:`pmetal.pipeline.compute`: why, and why a row's bits never depend
  on its batch);
* a stage fuses q, k and v into one matrix and gate and up into another, so a
  layer costs four matrix products instead of seven;
* everything is float32, including the rotary tables and the scalars: one
  float64 operand makes numpy promote, and then copy every weight matrix to
  float64 on every token (a 10x slowdown).

Rotary embeddings follow Hugging Face's "rotate half" convention (the first
half of each head against the second). GGUF files store q and k permuted for
the interleaved convention; a GGUF loader must undo that permutation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pmetal.errors import ConfigError, PMetalValueError
from pmetal.pipeline.compute import HELPER_KINDS, Projector, slices
from pmetal.pipeline.threads import compute_threads

# Plain sorted order, as tests/test_public_api.py asserts (not ruff's isort style).
__all__ = [  # noqa: RUF022
    "KVCache",
    "LayerWeights",
    "LlamaConfig",
    "LlamaStage",
    "LlamaWeights",
    "SMOLLM2_135M",
]

F32 = np.float32


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-architecture model (the fields of a Hugging Face
    ``config.json`` that matter to the arithmetic)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"LlamaConfig: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads}) for "
                "grouped-query attention")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"LlamaConfig: hidden_size ({self.hidden_size}) is not divisible by "
                    f"num_attention_heads ({self.num_attention_heads}); give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) \
                or self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(
                f"LlamaConfig.head_dim must be a positive even integer (rotary embeddings "
                f"rotate pairs), got {self.head_dim!r}")
        # Infinite values pass "> 0" and then fill the rotary tables or the
        # norms with NaN.
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"LlamaConfig.{name} must be a finite number > 0, "
                                  f"got {value!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(
                    f"LlamaConfig.{name} ({value}) is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})")

    @classmethod
    def from_hf_dict(cls, data: Mapping[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face ``config.json`` (already parsed).

        Refuses what this decoder does not compute (another architecture, rope
        scaling, biases, an activation other than SiLU) instead of producing
        wrong logits quietly."""
        architectures = data.get("architectures") or []
        model_type = data.get("model_type", "llama")
        if model_type != "llama" or any(a != "LlamaForCausalLM" for a in architectures):
            raise ConfigError(
                f"config.json describes model_type={model_type!r} architectures={architectures!r}; "
                "pmetal's decoder computes only Llama (LlamaForCausalLM) models")
        if data.get("rope_scaling"):
            raise ConfigError(
                f"config.json asks for rope_scaling={data['rope_scaling']!r}, which pmetal's "
                "decoder does not implement; use a model without rope scaling")
        if data.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json hidden_act={data['hidden_act']!r}; only 'silu' is supported")
        if data.get("attention_bias") or data.get("mlp_bias"):
            raise ConfigError("config.json asks for attention or MLP biases, which pmetal's "
                              "decoder does not implement")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in data]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        eos = data.get("eos_token_id")
        if isinstance(eos, list):  # several stop ids: the first is the canonical one
            eos = eos[0] if eos else None
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=data["num_attention_heads"],
            num_key_value_heads=data.get("num_key_value_heads", data["num_attention_heads"]),
            head_dim=data.get("head_dim") or 0,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)),
            rope_theta=float(data.get("rope_theta", 10000.0)),
            max_position_embeddings=data.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=eos,
        )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_parameters(self) -> int:
        """Parameters in one decoder layer (for memory estimates)."""
        h = self.hidden_size
        return (h * (self.q_size + 2 * self.kv_size) + self.q_size * h
                + 3 * h * self.intermediate_size + 2 * h)


# SmolLM2-135M-Instruct, the default model. Values from its config.json as
# remembered; TO CHECK against the GGUF metadata once the loader exists.
SMOLLM2_135M = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, every projection float32 ``(out, in)`` like a
    Hugging Face ``nn.Linear`` weight."""

    attn_norm: np.ndarray   # (hidden,)
    wq: np.ndarray          # (heads * head_dim, hidden)
    wk: np.ndarray          # (kv_heads * head_dim, hidden)
    wv: np.ndarray          # (kv_heads * head_dim, hidden)
    wo: np.ndarray          # (hidden, heads * head_dim)
    mlp_norm: np.ndarray    # (hidden,)
    w_gate: np.ndarray      # (intermediate, hidden)
    w_up: np.ndarray        # (intermediate, hidden)
    w_down: np.ndarray      # (hidden, intermediate)

    def check(self, config: LlamaConfig, index: int) -> None:
        h, i = config.hidden_size, config.intermediate_size
        expected = {"attn_norm": (h,), "wq": (config.q_size, h), "wk": (config.kv_size, h),
                    "wv": (config.kv_size, h), "wo": (h, config.q_size), "mlp_norm": (h,),
                    "w_gate": (i, h), "w_up": (i, h), "w_down": (h, i)}
        for name, shape in expected.items():
            array = getattr(self, name)
            if array.shape != shape or array.dtype != F32:
                raise PMetalValueError(
                    f"layer {index} {name}: expected float32 {shape}, got {array.dtype} "
                    f"{array.shape}")


@dataclass(frozen=True)
class LlamaWeights:
    """The weights of layers ``[start, start + len(layers))`` of a model, plus
    the embedding when ``start == 0`` and the final norm and LM head when the
    range ends at the last layer. ``lm_head`` is ``(vocab, hidden)`` like the
    embedding; with tied embeddings it is the same array."""

    config: LlamaConfig
    start: int
    layers: tuple[LayerWeights, ...]
    embed_tokens: np.ndarray | None = None  # (vocab, hidden), first stage only
    norm: np.ndarray | None = None          # (hidden,), last stage only
    lm_head: np.ndarray | None = None       # (vocab, hidden), last stage only

    def __post_init__(self) -> None:
        c = self.config
        if not 0 <= self.start <= self.end <= c.num_hidden_layers:
            raise PMetalValueError(
                f"layers [{self.start}, {self.end}) do not fit a model of "
                f"{c.num_hidden_layers} layers")
        for offset, layer in enumerate(self.layers):
            layer.check(c, self.start + offset)
        table = (c.vocab_size, c.hidden_size)
        for name, present, shape in (("embed_tokens", self.start == 0, table),
                                     ("norm", self.is_last, (c.hidden_size,)),
                                     ("lm_head", self.is_last, table)):
            array = getattr(self, name)
            if present and (array is None or array.shape != shape or array.dtype != F32):
                raise PMetalValueError(
                    f"{name}: layers [{self.start}, {self.end}) need a float32 {shape} array, "
                    f"got {None if array is None else (array.dtype, array.shape)}")

    @property
    def end(self) -> int:
        return self.start + len(self.layers)

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.config.num_hidden_layers

    def slice(self, start: int, end: int) -> LlamaWeights:
        """The weights a stage running layers ``[start, end)`` needs; arrays
        are shared, not copied."""
        if not self.start <= start <= end <= self.end:
            raise PMetalValueError(
                f"cannot slice layers [{start}, {end}) out of [{self.start}, {self.end})")
        if start == end:
            raise PMetalValueError(f"layer range [{start}, {end}) is empty")
        is_last = end == self.config.num_hidden_layers
        return LlamaWeights(
            config=self.config, start=start,
            layers=self.layers[start - self.start:end - self.start],
            embed_tokens=self.embed_tokens if start == 0 else None,
            norm=self.norm if is_last else None,
            lm_head=self.lm_head if is_last else None)

    @classmethod
    def random(cls, config: LlamaConfig, seed: int = 0) -> LlamaWeights:
        """A whole model of random weights, scaled like an initialised network
        (std 1/sqrt(fan_in)) so activations stay finite over many layers.
        ``seed`` makes it reproducible."""
        rng = np.random.default_rng(seed)
        h, i = config.hidden_size, config.intermediate_size

        def matrix(fan_in: int, fan_out: int) -> np.ndarray:
            return (rng.standard_normal((fan_out, fan_in), dtype=F32)
                    * F32(1.0 / math.sqrt(fan_in)))

        def norm() -> np.ndarray:
            return (1.0 + 0.1 * rng.standard_normal(h, dtype=F32)).astype(F32)

        layers = tuple(
            LayerWeights(attn_norm=norm(), wq=matrix(h, config.q_size),
                         wk=matrix(h, config.kv_size), wv=matrix(h, config.kv_size),
                         wo=matrix(config.q_size, h), mlp_norm=norm(),
                         w_gate=matrix(h, i), w_up=matrix(h, i), w_down=matrix(i, h))
            for _ in range(config.num_hidden_layers))
        # A small embedding, as in a trained model: one that dominates the
        # residual stream makes a tied head echo the input token forever.
        embed = rng.standard_normal((config.vocab_size, h), dtype=F32) * F32(0.1)
        head = embed if config.tie_word_embeddings else (
            rng.standard_normal((config.vocab_size, h), dtype=F32) * F32(1.0 / math.sqrt(h)))
        return cls(config=config, start=0, layers=layers, embed_tokens=embed,
                   norm=norm(), lm_head=head)


class KVCache:
    """Keys and values of one sequence for the layers of one stage,
    preallocated up to ``max_len`` positions. ``length`` is how many
    positions are filled; the stage advances it after its last layer."""

    def __init__(self, config: LlamaConfig, num_layers: int, max_len: int) -> None:
        if max_len <= 0 or max_len > config.max_position_embeddings:
            raise PMetalValueError(
                f"KV cache length {max_len} must be in 1..{config.max_position_embeddings} "
                "(the model's max_position_embeddings)")
        shape = (num_layers, config.num_key_value_heads, max_len, config.head_dim)
        self.keys = np.zeros(shape, dtype=F32)
        self.values = np.zeros(shape, dtype=F32)
        self.max_len = max_len
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def reset(self) -> None:
        """Forget the sequence; the buffers are reused."""
        self.length = 0


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (F32(1.0) / np.sqrt(variance + eps)) * weight


def _silu(x: np.ndarray) -> np.ndarray:
    # sigmoid via tanh: no overflow warning for very negative inputs, unlike exp(-x)
    return x * (F32(0.5) + F32(0.5) * np.tanh(F32(0.5) * x))


class LlamaStage:
    """Runs layers ``[weights.start, weights.end)`` of a model on hidden
    states. ``embed`` needs the first stage, ``logits`` the last.

    One instance serves many sequences: each has its own :class:`KVCache`
    from :meth:`new_cache`. :meth:`forward` runs a prefill (many tokens) or
    one decode token of one sequence; :meth:`forward_batch` runs one decode
    token of each of several sequences at once, so every weight matrix is
    read once for all of them.

    The stage copies q, k, v and gate, up into fused matrices: drop the
    :class:`LlamaWeights` once the stage is built to free the originals.

    The stage computes on the process's compute threads
    (:func:`pmetal.pipeline.threads.set_compute_threads`: a pipeline stage
    sharing a machine with other stages sets fewer); any count gives the
    same bits (see :mod:`pmetal.pipeline.compute`). Decode products are
    shared with up to ``max_threads - 1`` helpers (default: the compute
    threads when the stage is built): processes that map the weights from
    shared memory on Linux (``helpers="auto"`` or ``"processes"``), threads
    elsewhere or with ``helpers="threads"``. One thread at a time computes
    on a stage; :meth:`rest` tells its helpers the stage will wait for input,
    :meth:`close` ends them."""

    def __init__(self, weights: LlamaWeights, *, max_threads: int | None = None,
                 helpers: str = "auto") -> None:
        if not weights.layers:
            raise PMetalValueError("a stage needs at least one layer")
        if max_threads is not None and (isinstance(max_threads, bool)
                                        or not isinstance(max_threads, int) or max_threads < 1):
            raise PMetalValueError(f"max_threads must be a positive integer, got {max_threads!r}")
        if helpers not in HELPER_KINDS:
            raise PMetalValueError(
                f"helpers={helpers!r}: choose from {', '.join(HELPER_KINDS)}")
        c = self.config = weights.config
        self.start, self.end = weights.start, weights.end
        self._eps = F32(c.rms_norm_eps)
        self._scale = F32(1.0 / math.sqrt(c.head_dim))
        self._group = c.num_attention_heads // c.num_key_value_heads
        self._attn_norm = [w.attn_norm for w in weights.layers]
        self._mlp_norm = [w.mlp_norm for w in weights.layers]
        self._norm = weights.norm
        # Fused projections: one product for q, k, v and one for gate, up.
        n = len(weights.layers)
        parts: list[tuple[np.ndarray, ...]] = []
        for w in weights.layers:
            parts += [(w.wq, w.wk, w.wv), (w.wo,), (w.w_gate, w.w_up), (w.w_down,)]
        if weights.lm_head is not None:
            parts.append((weights.lm_head,))
        self._project = Projector(parts, max_threads or compute_threads() or 1, helpers)
        matrices = self._project.matrices
        self._wqkv, self._wo = matrices[0:4 * n:4], matrices[1:4 * n:4]
        self._wgu, self._wdown = matrices[2:4 * n:4], matrices[3:4 * n:4]
        self._head = matrices[4 * n] if weights.lm_head is not None else None
        # A tied embedding is the head: one copy.
        self._embed = self._head if (weights.embed_tokens is not None
                                     and weights.embed_tokens is weights.lm_head) \
            else weights.embed_tokens
        # Slice boundaries depend on a matrix's shape only: every layer's alike.
        self._qkv_slices = slices(self._wqkv[0])
        self._wo_slices = slices(self._wo[0])
        self._gu_slices = slices(self._wgu[0])
        self._down_slices = slices(self._wdown[0])
        self._head_slices = None if self._head is None else slices(self._head)
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float64)
                                           / c.head_dim))
        angles = np.outer(np.arange(c.max_position_embeddings, dtype=np.float64), inv_freq)
        self._cos = np.cos(angles).astype(F32)  # (max_pos, head_dim / 2)
        self._sin = np.sin(angles).astype(F32)

    def close(self) -> None:
        """End the compute helpers (the stage still computes, on one
        thread until it next needs more)."""
        self._project.close()

    def rest(self) -> None:
        """This stage will wait for input: its compute helpers stop
        spinning now instead of after a few milliseconds."""
        self._project.rest()

    @property
    def helpers(self) -> str | None:
        """What computes beside the caller: ``processes``, ``threads`` or
        ``None`` (nothing yet)."""
        return self._project.kind

    @property
    def helper_pids(self) -> list[int]:
        """Process ids of the stage's helper processes (empty without)."""
        return self._project.helper_pids

    def _proj(self, x: np.ndarray, weight: np.ndarray, ranges: list[tuple[int, int]]
              ) -> np.ndarray:
        return self._project(x, weight, ranges, compute_threads() or 1)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache for one sequence of at most ``max_len`` tokens
        (default: the model's max_position_embeddings)."""
        return KVCache(self.config, self.num_layers,
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
        return self._embed[ids]

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """Logits ``(T, vocab)`` after the final norm (last stage only)."""
        if self._head is None or self._norm is None:
            raise PMetalValueError(
                f"stage [{self.start}, {self.end}) is not the last stage: it has no LM head")
        return self._proj(_rms_norm(self._as_hidden(hidden), self._norm, self._eps),
                             self._head, self._head_slices)

    def _as_hidden(self, hidden: np.ndarray) -> np.ndarray:
        if hidden.dtype != F32 or hidden.ndim != 2 or hidden.shape[1] != self.config.hidden_size:
            raise PMetalValueError(
                f"hidden states must be float32 (T, {self.config.hidden_size}), got "
                f"{hidden.dtype} {hidden.shape}")
        return hidden

    def _rotate(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotary embedding of ``x`` (T, heads, head_dim) at ``positions`` (T,)."""
        half = self.config.head_dim // 2
        cos = self._cos[positions][:, None, :]
        sin = self._sin[positions][:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _qkv(self, layer: int, x: np.ndarray, positions: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.config
        qkv = self._proj(_rms_norm(x, self._attn_norm[layer], self._eps), self._wqkv[layer],
                            self._qkv_slices)
        t = x.shape[0]
        q = self._rotate(qkv[:, :c.q_size].reshape(t, c.num_attention_heads, c.head_dim), positions)
        k = self._rotate(qkv[:, c.q_size:c.q_size + c.kv_size]
                         .reshape(t, c.num_key_value_heads, c.head_dim), positions)
        v = qkv[:, c.q_size + c.kv_size:].reshape(t, c.num_key_value_heads, c.head_dim)
        return q, k, v

    def _mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        gu = self._proj(_rms_norm(x, self._mlp_norm[layer], self._eps), self._wgu[layer],
                           self._gu_slices)
        inter = self.config.intermediate_size
        return x + self._proj(_silu(gu[:, :inter]) * gu[:, inter:], self._wdown[layer],
                                 self._down_slices)

    def _attend(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                first: int) -> np.ndarray:
        """Attention of queries ``q`` (T, heads, hd) at positions first..first+T-1
        over ``keys``/``values`` (kv_heads, first+T, hd); causal. Returns (T, q_size)."""
        c = self.config
        t = q.shape[0]
        # (kv_heads, group * T, hd): the heads sharing one key-value head side by side
        qg = q.reshape(t, c.num_key_value_heads, self._group, c.head_dim) \
              .transpose(1, 2, 0, 3).reshape(c.num_key_value_heads, self._group * t, c.head_dim)
        scores = np.matmul(qg, keys.transpose(0, 2, 1))
        scores *= self._scale
        if t > 1:
            span = keys.shape[1]
            row = np.tile(np.arange(first, first + t), self._group)
            scores[:, np.arange(span)[None, :] > row[:, None]] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = np.matmul(scores, values)  # (kv_heads, group * T, hd)
        return out.reshape(c.num_key_value_heads, self._group, t, c.head_dim) \
                  .transpose(2, 0, 1, 3).reshape(t, c.q_size)

    def forward(self, hidden: np.ndarray, cache: KVCache) -> np.ndarray:
        """Run this stage's layers on ``hidden`` (T, hidden), the next T
        tokens of the sequence whose cache this is; returns (T, hidden)."""
        x = self._as_hidden(hidden)
        t, first = x.shape[0], cache.length
        if first + t > cache.max_len:
            raise PMetalValueError(
                f"sequence would reach {first + t} tokens, beyond its KV cache of {cache.max_len}")
        positions = np.arange(first, first + t)
        for layer in range(self.num_layers):
            q, k, v = self._qkv(layer, x, positions)
            cache.keys[layer, :, first:first + t] = k.transpose(1, 0, 2)
            cache.values[layer, :, first:first + t] = v.transpose(1, 0, 2)
            attn = self._attend(q, cache.keys[layer, :, :first + t],
                                cache.values[layer, :, :first + t], first)
            x = x + self._proj(attn, self._wo[layer], self._wo_slices)
            x = self._mlp(layer, x)
        cache.length = first + t
        return x

    def forward_batch(self, hidden: np.ndarray, caches: Sequence[KVCache]) -> np.ndarray:
        """One decode token for each of ``len(caches)`` sequences: ``hidden``
        (B, hidden), row i the next token of the sequence of ``caches[i]``,
        which may all be at different positions. Projections run as one GEMM
        over the batch; attention runs per sequence over its own cache."""
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
        for layer in range(self.num_layers):
            q, k, v = self._qkv(layer, x, positions)
            attn = np.empty((len(caches), self.config.q_size), dtype=F32)
            for row, cache in enumerate(caches):
                pos = cache.length
                cache.keys[layer, :, pos] = k[row]
                cache.values[layer, :, pos] = v[row]
                attn[row] = self._attend(q[row:row + 1], cache.keys[layer, :, :pos + 1],
                                         cache.values[layer, :, :pos + 1], pos)[0]
            x = x + self._proj(attn, self._wo[layer], self._wo_slices)
            x = self._mlp(layer, x)
        for cache in caches:
            cache.length += 1
        return x

