"""Which engine computes a stage: the backend names and ``auto``'s choice."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from pmetal.errors import ConfigError
from pmetal.model.quantized import QuantizedStage
from pmetal.pipeline.backends import BACKENDS, build_stage, resolve_backend
from pmetal.pipeline.llama import LlamaStage
from pmetal.pipeline.llama_mlx import mlx_available
from pmetal.pipeline.stage import PipelineStageConfig
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

APPLE = platform.system() == "Darwin" and platform.machine() == "arm64"


def test_auto_picks_by_the_table() -> None:
    if APPLE and mlx_available():
        assert resolve_backend("auto", gguf=True) == "mlx"
    else:
        assert resolve_backend("auto", gguf=True) == "quantized"
        assert resolve_backend("auto", gguf=False) == "reference"
    for name in ("quantized", "reference"):
        assert resolve_backend(name, gguf=False) == name


def test_an_unknown_backend_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match="backend 'numpy': choose from " + ", ".join(BACKENDS)):
        resolve_backend("numpy", gguf=True)
    with pytest.raises(ConfigError, match="backend 'torch'"):
        PipelineStageConfig(start=0, end=1, index=0, num_stages=1, model="x", backend="torch")


@pytest.mark.skipif(APPLE, reason="auto means MLX on Apple silicon")
def test_a_gguf_stage_is_quantized_and_a_random_one_is_the_reference(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    config = tiny_config()
    write_tiny_gguf(path, config, quantize=True)
    stage = build_stage(PipelineStageConfig(start=0, end=2, index=0, num_stages=2,
                                            model=str(path)))
    assert isinstance(stage, QuantizedStage) and (stage.start, stage.end) == (0, 2)
    reference = build_stage(PipelineStageConfig(start=0, end=2, index=0, num_stages=2,
                                                model=str(path), backend="reference"))
    assert isinstance(reference, LlamaStage)
    random = build_stage(PipelineStageConfig(start=0, end=4, index=0, num_stages=1,
                                             random_model=dict(config.__dict__)))
    assert isinstance(random, LlamaStage)


@pytest.mark.skipif(not mlx_available(), reason="mlx is not installed: no MLX backend here")
def test_mlx_keeps_a_gguf_model_quantized_and_a_random_one_float(tmp_path: Path) -> None:
    import mlx.core as mx

    from pmetal.model.mlx import MlxQuantizedStage
    from pmetal.pipeline.llama_mlx import MlxLlamaStage

    path = tmp_path / "tiny.gguf"
    config = tiny_config()
    write_tiny_gguf(path, config, quantize=True)
    stage = build_stage(PipelineStageConfig(start=1, end=4, index=1, num_stages=2,
                                            model=str(path), backend="mlx"))
    assert type(stage) is MlxQuantizedStage and (stage.start, stage.end) == (1, 4)
    assert {m.bits for m in stage.matrices()} == {8}  # Q8_0 stays 8-bit
    random = build_stage(PipelineStageConfig(start=0, end=4, index=0, num_stages=1,
                                             random_model=dict(config.__dict__),
                                             backend="mlx"))
    assert isinstance(random, MlxLlamaStage)
    assert {m.dense.dtype for m in random.matrices()} == {mx.float32}
