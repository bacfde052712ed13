"""The model engine: a decoder's arithmetic apart from its distribution.

What lives here knows nothing of actors, sockets or files: a model's shape
(:mod:`pmetal.model.config`), a sequence's key-value cache
(:mod:`pmetal.model.cache`), the fused quantized kernels
(:mod:`pmetal.model.kernels`) and the engines that run a contiguous range of
a model's layers: in numpy on those kernels (:mod:`pmetal.model.quantized`),
or in MLX on its own quantized products (:mod:`pmetal.model.mlx`, the blocks
converted by :mod:`pmetal.model.mlxblocks`), all following one protocol
(:class:`pmetal.model.engine.StageEngine`). :mod:`pmetal.pipeline` loads weights and moves
hidden states between the stages that run these engines.
"""

from __future__ import annotations

__all__: list[str] = []
