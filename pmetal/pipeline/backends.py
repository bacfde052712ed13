"""Which engine computes a stage, and loading its weights in that engine's form.

Three backends share one interface (``embed``, ``forward``,
``forward_batch``, ``logits``, ``new_cache``, ``rest``, ``close``):

========== ======================================== ==========================
backend    weights in memory                        where it is the default
========== ======================================== ==========================
quantized  GGUF blocks, mapped from the file        GGUF models off Apple silicon
           (:mod:`pmetal.model.quantized`)
mlx        GGUF: MLX's affine quantization (the     Apple silicon with MLX
           blocks rewritten, Q6_K as float16);
           other models: float32 MLX arrays
           (:mod:`pmetal.model.mlx`)
reference  float32 numpy, dequantized at load       random test models,
           (:mod:`pmetal.pipeline.llama`)           Hugging Face folders
========== ======================================== ==========================

``auto`` picks by that table. The reference is the float32 decoder every
other backend is checked against. A random model (tests, benchmarks) in the
quantized backend is quantized to Q8_0 blocks at load, so that pipelines of
the quantized engine are tested without a model file.

Backends agree to their arithmetic's rounding, not bit for bit: every stage
of a pipeline runs the same backend, and within a backend a pipeline of K
stages produces the single-process tokens exactly.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pmetal.errors import ConfigError
from pmetal.pipeline.llama import LlamaConfig, LlamaStage, LlamaWeights
from pmetal.pipeline.llama_mlx import MlxLlamaStage, mlx_available
from pmetal.pipeline.threads import compute_threads

if TYPE_CHECKING:
    from pmetal.pipeline.stage import PipelineStageConfig

__all__ = ["BACKENDS", "build_stage", "resolve_backend"]

BACKENDS = ("auto", "quantized", "reference", "mlx")


def resolve_backend(backend: str, *, gguf: bool) -> str:
    """The backend ``backend`` names for a model that is (``gguf``) or is not
    a GGUF file; ``auto`` resolved, unknown names refused."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if backend == "auto":
        apple = platform.system() == "Darwin" and platform.machine() == "arm64"
        if apple and mlx_available():
            return "mlx"
        return "quantized" if gguf else "reference"
    if backend == "mlx" and not mlx_available():
        raise ConfigError("backend 'mlx' asked for, but mlx is not installed (pip install mlx; "
                          "on Linux: pip install 'mlx[cpu]'), or choose another backend")
    return backend


def build_stage(config: PipelineStageConfig, *, max_threads: int | None = None,
                weights: LlamaWeights | None = None) -> Any:
    """The engine of one stage: its layers loaded in the form its backend
    computes on (only the stage's own range). ``weights`` (float32, already
    sliced to the stage) stand in for the model file."""
    if weights is not None or config.random_model is not None:
        backend = resolve_backend(config.backend, gguf=False)
        if weights is None:
            model = LlamaConfig(**config.random_model)  # type: ignore[arg-type]
            weights = LlamaWeights.random(model, seed=config.seed).slice(config.start,
                                                                         config.end)
        return _from_float(weights, backend, max_threads)
    from pmetal.pipeline import loader  # gguf loads only when used

    gguf = loader.is_gguf(Path(config.model))
    backend = resolve_backend(config.backend, gguf=gguf)
    if backend == "quantized":
        return _quantized(loader.load_quantized(config.model, config.start, config.end),
                          max_threads)
    if backend == "mlx" and gguf:
        from pmetal.model.mlx import MlxQuantizedStage

        # The stage keeps MLX copies, not the blocks: the file's map closes with them.
        return MlxQuantizedStage(loader.load_quantized(config.model, config.start, config.end))
    return _from_float(loader.load_weights(config.model, config.start, config.end), backend,
                       max_threads)


def _from_float(weights: LlamaWeights, backend: str, max_threads: int | None) -> Any:
    if backend == "mlx":
        return MlxLlamaStage(weights)
    if backend == "quantized":
        from pmetal.model.quantized import QuantizedWeights

        return _quantized(QuantizedWeights.from_float(weights), max_threads)
    return LlamaStage(weights, max_threads=max_threads)


def _quantized(weights: Any, max_threads: int | None) -> Any:
    from pmetal.model.quantized import QuantizedStage

    return QuantizedStage(weights, max_threads=max_threads, threads=compute_threads)
