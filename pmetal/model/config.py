"""The shape of a decoder model: what every backend's arithmetic needs to know.

What it owns: :class:`LlamaConfig`, the fields of a Hugging Face
``config.json`` (or a GGUF file's metadata) that change the arithmetic,
validated once, and :data:`SMOLLM2_135M`, the default model's shape. The
architectures it describes share Llama's layer (RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU) and differ in a few switches:

========== ================================= =====================
family     difference from Llama             switch
========== ================================= =====================
llama      (the reference)
mistral    none at these context lengths      ``architecture``
qwen2      biases on q, k and v               ``attention_bias``
qwen3      RMSNorm of each q and k head        ``qk_norm``
========== ================================= =====================

Anything else (mixture of experts, rope scaling, partial rotary, sliding
windows that bite) is refused by name before a weight loads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pmetal.errors import ConfigError

__all__ = ["ARCHITECTURES", "LlamaConfig", "SMOLLM2_135M"]

# architecture -> (attention_bias, qk_norm) it implies
ARCHITECTURES: Mapping[str, tuple[bool, bool]] = {
    "llama": (False, False), "mistral": (False, False),
    "qwen2": (True, False), "qwen3": (False, True)}


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
    architecture: str = "llama"
    attention_bias: bool = False    # q, k and v projections have biases (Qwen2)
    qk_norm: bool = False           # each q and k head is RMS-normalised before rotary (Qwen3)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not one pmetal computes: "
                f"{', '.join(ARCHITECTURES)}")
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


# SmolLM2-135M-Instruct, the default model (its GGUF metadata agrees:
# tests/pipeline/test_default_model.py).
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
