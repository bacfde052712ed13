"""The shape of a decoder model: what every backend's arithmetic needs to know.

What it owns: :class:`LlamaConfig`, the fields of a Hugging Face
``config.json`` (or a GGUF file's metadata) that change the arithmetic,
validated once, and :data:`SMOLLM2_135M`, the default model's shape. The
architectures it describes share Llama's layer (RMSNorm, rotary
embeddings, grouped-query attention, SwiGLU) and differ in a few switches,
which the architecture implies (:data:`ARCHITECTURES`):

============ ================================== ==================
architecture difference from Llama                switch
============ ================================== ==================
llama        (the reference)
mistral      a sliding window (see below)
qwen2        biases on q, k and v               ``attention_bias``
qwen3        RMSNorm of each q and k head,      ``qk_norm``
             before the rotary embedding
============ ================================== ==================

A sliding window of W positions (Mistral 7B v0.1; Qwen with
``use_sliding_window``) changes nothing while a sequence is at most W
tokens long, so :meth:`LlamaConfig.from_hf_dict` lowers
``max_position_embeddings`` to the window (logging a warning) instead of
refusing the model: every sequence this config admits is computed exactly.

Anything else (mixture of experts, rope scaling, partial rotary, biases on
other projections) is refused by name before a weight loads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pmetal.errors import ConfigError

__all__ = ["ARCHITECTURES", "LlamaConfig", "SMOLLM2_135M"]

log = logging.getLogger(__name__)

# architecture -> (attention_bias, qk_norm) it implies
ARCHITECTURES: Mapping[str, tuple[bool, bool]] = {
    "llama": (False, False), "mistral": (False, False),
    "qwen2": (True, False), "qwen3": (False, True)}

# Hugging Face class (``architectures``) and ``model_type`` -> architecture
_HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a decoder of one of :data:`ARCHITECTURES` (the fields of
    a Hugging Face ``config.json`` that matter to the arithmetic)."""

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
    architecture: str = "llama"     # one of ARCHITECTURES; it implies the switches below

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

        Refuses what the decoder does not compute (another architecture, rope
        scaling, biases other than Qwen2's, an activation other than SiLU)
        instead of producing wrong logits quietly; lowers
        ``max_position_embeddings`` to a sliding window that would otherwise
        bite (see the module's docstring)."""
        architecture = _hf_architecture(data)
        theta = data.get("rope_theta", 10000.0)
        parameters = data.get("rope_parameters")
        if isinstance(parameters, Mapping):  # transformers >= 5 moves rope_theta here
            if parameters.get("rope_type", "default") != "default":
                raise ConfigError(
                    f"config.json asks for rope_parameters={dict(parameters)!r}, a rope "
                    "scaling pmetal's decoder does not implement; use a model without it")
            theta = parameters.get("rope_theta", theta)
        if data.get("rope_scaling"):
            raise ConfigError(
                f"config.json asks for rope_scaling={data['rope_scaling']!r}, which pmetal's "
                "decoder does not implement; use a model without rope scaling")
        if data.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"config.json asks for partial_rotary_factor="
                              f"{data['partial_rotary_factor']!r}; pmetal's decoder rotates "
                              "every head dimension")
        if data.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json hidden_act={data['hidden_act']!r}; only 'silu' is supported")
        # Qwen2 has q, k and v biases whatever attention_bias says (its config
        # has none); in Llama and Qwen3 attention_bias adds one to o as well,
        # Mistral has none.
        if (data.get("attention_bias") and architecture != "qwen2") or data.get("mlp_bias"):
            raise ConfigError(f"config.json asks for attention or MLP biases, which pmetal's "
                              f"decoder does not implement for {architecture}")
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
            rope_theta=float(theta),
            max_position_embeddings=_context(data, architecture),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=eos,
            architecture=architecture,
        )

    @property
    def attention_bias(self) -> bool:
        """Whether q, k and v projections have biases (Qwen2)."""
        return ARCHITECTURES[self.architecture][0]

    @property
    def qk_norm(self) -> bool:
        """Whether each q and k head is RMS-normalised before rotary (Qwen3)."""
        return ARCHITECTURES[self.architecture][1]

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
                + 3 * h * self.intermediate_size + 2 * h
                + (self.q_size + 2 * self.kv_size) * self.attention_bias
                + 2 * self.head_dim * self.qk_norm)


def _hf_architecture(data: Mapping[str, Any]) -> str:
    """The architecture a ``config.json`` names, refused unless pmetal
    computes it and its class and ``model_type`` agree."""
    classes = data.get("architectures") or []
    model_type = data.get("model_type")
    named = {_HF_CLASSES.get(c) for c in classes}
    if model_type is not None or not classes:
        named.add(_HF_MODEL_TYPES.get(model_type or "llama"))
    if None in named or len(named) != 1:
        raise ConfigError(
            f"config.json describes model_type={model_type!r} architectures={classes!r}; "
            f"pmetal's decoder computes {', '.join(_HF_CLASSES)} models")
    return named.pop()


def _context(data: Mapping[str, Any], architecture: str) -> Any:
    """``max_position_embeddings``, lowered to a sliding window that is on
    and shorter: no sequence then reaches the positions where it bites."""
    context = data.get("max_position_embeddings", 2048)
    # Mistral's window is on whenever given; Qwen's only with use_sliding_window.
    on = architecture == "mistral" or bool(data.get("use_sliding_window"))
    window = data.get("sliding_window") if on else None
    if window is None or not isinstance(context, int) or isinstance(context, bool):
        return context
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"config.json sliding_window={window!r} is not a positive integer")
    if window < context:
        log.warning("%s attends over a sliding window of %s positions: sequences are limited "
                    "to %s tokens (max_position_embeddings is %s), where the window changes "
                    "nothing", architecture, window, window, context)
        return window
    return context


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
