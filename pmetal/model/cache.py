"""A sequence's key-value cache for the layers of one stage (numpy backends).

What it owns: the preallocated key and value buffers of one sequence and
how many positions are filled. The reference and the quantized backends
share it; the MLX backend has its own (MLX arrays are not updated in place).
"""

from __future__ import annotations

import numpy as np

from pmetal.errors import PMetalValueError
from pmetal.model.config import LlamaConfig

__all__ = ["KVCache"]

F32 = np.float32


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
