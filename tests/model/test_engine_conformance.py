"""One contract, every engine (pmetal.model.engine.StageEngine): the quantized
engine, the MLX engine (when mlx imports) and the float32 reference, each
built from the same tiny Q8_0 GGUF file as a pipeline stage builds it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pmetal.errors import PMetalValueError
from pmetal.model.engine import StageEngine
from pmetal.model.quantized import QuantizedStage
from pmetal.pipeline.llama import LlamaStage
from pmetal.pipeline.llama_mlx import mlx_available
from pmetal.pipeline.loader import load_quantized, load_weights
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [11, 12], [200, 201, 202]]
CONFIG = tiny_config(layers=4)


def _mlx(path: Path, start: int, end: int) -> Any:
    from pmetal.model.mlx import MlxQuantizedStage
    return MlxQuantizedStage(load_quantized(path, start, end))


ENGINES: dict[str, Callable[[Path, int, int], Any]] = {
    "quantized": lambda path, a, b: QuantizedStage(load_quantized(path, a, b)),
    "reference": lambda path, a, b: LlamaStage(load_weights(path, a, b)),
    "mlx": _mlx,
}
# Within an engine: bits for the numpy engines, float rounding for MLX.
EXACT = {"quantized": True, "reference": True, "mlx": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conformance") / "tiny.gguf"
    write_tiny_gguf(path, CONFIG, seed=21, quantize=True)
    return path


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    if request.param == "mlx" and not mlx_available():
        pytest.skip("mlx is not installed (pip install 'mlx[cpu]' on Linux)")
    return request.param


def same(name: str, a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a, b) if EXACT[name] else np.allclose(a, b, atol=1e-4, rtol=1e-4))


def greedy(stages: list[Any], prompt: list[int], steps: int) -> list[int]:
    caches = [s.new_cache(64) for s in stages]

    def through(hidden: np.ndarray, batch: bool) -> np.ndarray:
        for s, c in zip(stages, caches, strict=True):
            hidden = s.forward_batch(hidden, [c]) if batch else s.forward(hidden, c)
        return hidden

    tokens = [int(stages[-1].logits(through(stages[0].embed(prompt), False)[-1:])[0].argmax())]
    for _ in range(steps):
        hidden = through(stages[0].embed(tokens[-1:]), True)
        tokens.append(int(stages[-1].logits(hidden)[0].argmax()))
    return tokens


def test_every_engine_follows_the_protocol(model: Path, engine: str) -> None:
    stage = ENGINES[engine](model, 0, CONFIG.num_hidden_layers)
    assert isinstance(stage, StageEngine)
    assert (stage.start, stage.end) == (0, CONFIG.num_hidden_layers)
    hidden = stage.embed(PROMPTS[0])
    assert hidden.dtype == np.float32 and hidden.shape == (7, CONFIG.hidden_size)
    out = stage.forward(hidden, stage.new_cache(16))
    assert out.dtype == np.float32 and out.shape == hidden.shape
    logits = stage.logits(out[-1:])
    assert logits.dtype == np.float32 and logits.shape == (1, CONFIG.vocab_size)
    stage.rest()
    stage.close()


def test_first_and_last_stage_duties_are_refused_elsewhere(model: Path, engine: str) -> None:
    first, last = ENGINES[engine](model, 0, 2), ENGINES[engine](model, 2, 4)
    with pytest.raises(PMetalValueError):
        first.logits(np.zeros((1, CONFIG.hidden_size), np.float32))
    with pytest.raises(PMetalValueError):
        last.embed([1])
    with pytest.raises(PMetalValueError):
        first.embed([CONFIG.vocab_size])


def test_k_stages_answer_as_one(model: Path, engine: str) -> None:
    build = ENGINES[engine]
    whole = [build(model, 0, 4)]
    split = [build(model, 0, 1), build(model, 1, 3), build(model, 3, 4)]
    for prompt in PROMPTS:
        assert greedy(split, prompt, 8) == greedy(whole, prompt, 8)


def test_a_row_in_a_batch_is_the_row_alone(model: Path, engine: str) -> None:
    stage = ENGINES[engine](model, 0, 4)
    caches, alone, tokens = [], [], []
    for prompt in PROMPTS:
        cache, solo = stage.new_cache(32), stage.new_cache(32)
        hidden = stage.forward(stage.embed(prompt), cache)
        stage.forward(stage.embed(prompt), solo)
        caches.append(cache)
        alone.append(solo)
        tokens.append(int(stage.logits(hidden[-1:])[0].argmax()))
    batched = stage.forward_batch(stage.embed(tokens), caches)
    for row, (token, solo) in enumerate(zip(tokens, alone, strict=True)):
        assert same(engine, batched[row:row + 1], stage.forward_batch(stage.embed([token]), [solo]))


def test_every_engine_agrees_with_the_reference(model: Path, engine: str) -> None:
    """Within the quantized engine's bound (test_quantized.py: its 8-bit
    activations, 6% of the logits' scale); MLX and the reference compute in
    float32."""
    got = ENGINES[engine](model, 0, 4)
    ref = ENGINES["reference"](model, 0, 4)
    a = got.logits(got.forward(got.embed(PROMPTS[0]), got.new_cache(16)))
    b = ref.logits(ref.forward(ref.embed(PROMPTS[0]), ref.new_cache(16)))
    assert float(np.abs(a - b).max()) <= 0.06 * float(np.abs(b).max())
