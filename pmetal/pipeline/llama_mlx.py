"""The MLX engine on float32 weights: random models and Hugging Face folders.

:class:`MlxLlamaStage` is :class:`~pmetal.model.mlx.MlxQuantizedStage` (the
one MLX engine) built from a :class:`~pmetal.pipeline.llama.LlamaWeights`:
its matrices stay float32 in MLX, in Hugging Face's layout (rotate-half
rotary embeddings). A GGUF model does not come this way: the backends hand
its blocks to the engine directly (:mod:`pmetal.pipeline.backends`).

The MLX engine and the numpy decoder agree to float32 rounding, not bit for
bit: a pipeline whose stages mix backends does not promise the
single-process greedy output. :mod:`pmetal.pipeline.backends` picks one
backend for every stage.

``mlx`` is imported only when an MLX stage is built. On Linux (``mlx[cpu]``)
its matrix products are ~30x slower than numpy's OpenBLAS: ``auto``
therefore means MLX only on macOS on Apple silicon.
"""

from __future__ import annotations

from pmetal.model import kernels
from pmetal.model.mlx import MlxKVCache, MlxQuantizedStage, mlx_available
from pmetal.model.quantized import QuantizedWeights
from pmetal.pipeline.llama import LlamaWeights

__all__ = ["MlxKVCache", "MlxLlamaStage", "mlx_available"]


class MlxLlamaStage(MlxQuantizedStage):
    """Runs layers ``[weights.start, weights.end)`` of float32 weights in
    MLX; see :class:`~pmetal.pipeline.llama.LlamaStage` for the interface."""

    def __init__(self, weights: LlamaWeights) -> None:
        super().__init__(QuantizedWeights.from_float(weights, kernels.F32))
