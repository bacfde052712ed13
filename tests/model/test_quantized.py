"""The quantized engine against the float32 reference, and against itself.

The reference here is the float32 decoder on the same file's weights
dequantized by the ``gguf`` package: the two differ only by the kernels'
8-bit rounding of activations, so their logits agree to about a percent of
their scale (a wrong rotary layout, a missing bias or a swapped matrix
moves them by tens of percent). Against itself the engine is exact: a
sequence's bits do not depend on its batch, its thread count or the split
of its layers into stages.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pmetal.errors import PMetalValueError
from pmetal.model import kernels
from pmetal.model.ops import Rotary
from pmetal.model.quantized import QuantizedStage, QuantizedWeights
from pmetal.pipeline.llama import LlamaStage, LlamaWeights
from pmetal.pipeline.loader import load_quantized, load_weights
from tests.pipeline.kquants import T
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

PROMPT = [5, 17, 42, 9, 100, 3, 77]
# Logits of the engine and of the reference differ by the kernels' 8-bit
# rounding of activations (up to 1/254 of each 32-block's largest value per
# product), compounded over 4 layers of a random model: 2.6-3.6% of the
# logits' scale measured over seeds 3-5. The wrong rotary layout is off by
# 11-68% (test_a_wrong_rotary_layout_is_caught).
AGREEMENT = 0.06
# The same rounding on the Q5_0/Q5_1 model below moves its logits further:
# 5.4-9.7% over seeds 3-7 (its wrong rotary: 44-88%). A numpy emulation of
# the activation rounding alone (x rounded to int8 per 32-block, products in
# float64 of gguf's dequantized weights) moves the prefill logits as far as
# the kernels do (3.6-4.1% against 3.6-4.3%, seeds 3, 5, 6), so the gap is
# that rounding, not the Q5 kernels, which test_kernels.py bounds product by
# product.
Q5_AGREEMENT = 0.12


def close_to_reference(got: np.ndarray, want: np.ndarray, tolerance: float = AGREEMENT) -> None:
    scale = float(np.abs(want).max())
    error = float(np.abs(got - want).max())
    assert error <= tolerance * scale, f"error {error:.4g} beyond {tolerance} of {scale:.4g}"


# What llama.cpp's Q4_K_M/Q5_K_M keep for matrices whose rows are not a
# multiple of 256 (Qwen2.5-0.5B's 896): Q5_0 and Q5_1, here on rows of 64 and
# 96 (ffn_down), mixed with Q8_0.
Q5_TYPES = {"token_embd": T.Q5_1, "attn_q": T.Q5_0, "attn_k": T.Q5_1, "attn_v": T.Q8_0,
            "attn_output": T.Q5_1, "ffn_gate": T.Q5_0, "ffn_up": T.Q5_1, "ffn_down": T.Q5_0,
            "output": T.Q5_0}


@pytest.fixture(scope="module", params=["tied", "untied", "q5"])
def gguf_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("q") / f"tiny-{request.param}.gguf"
    if request.param == "q5":
        write_tiny_gguf(path, tiny_config(tied=False), seed=3, types=Q5_TYPES)
    else:
        write_tiny_gguf(path, tiny_config(tied=request.param == "tied"), seed=3, quantize=True)
    return path


def run(stage: object, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill, then greedy decode; every step's logits and the tokens."""
    cache = stage.new_cache(64)  # type: ignore[attr-defined]
    logits = [stage.logits(stage.forward(stage.embed(prompt), cache))[-1]]  # type: ignore[attr-defined]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        hidden = stage.forward_batch(stage.embed(tokens[-1:]), [cache])  # type: ignore[attr-defined]
        logits.append(stage.logits(hidden)[0])  # type: ignore[attr-defined]
        tokens.append(int(logits[-1].argmax()))
    return logits, tokens


def test_the_engine_agrees_with_the_reference_on_the_same_file(gguf_model: Path) -> None:
    engine = QuantizedStage(load_quantized(gguf_model))
    reference = LlamaStage(load_weights(gguf_model))
    got, _ = run(engine, PROMPT, 6)
    # The reference follows the engine's tokens, so the steps compare like with like.
    cache = reference.new_cache(64)
    want = [reference.logits(reference.forward(reference.embed(PROMPT), cache))[-1]]
    _, tokens = run(engine, PROMPT, 6)
    for token in tokens[:-1]:
        want.append(reference.logits(reference.forward_batch(reference.embed([token]),
                                                             [cache]))[0])
    tolerance = Q5_AGREEMENT if gguf_model.stem.endswith("q5") else AGREEMENT
    for g, w in zip(got, want, strict=True):
        close_to_reference(g, w, tolerance)


def test_a_wrong_rotary_layout_is_caught(gguf_model: Path) -> None:
    """The agreement bound is tight enough to catch a real mistake: the
    file's permuted q/k rows rotated as Hugging Face's halves."""
    wrong = QuantizedStage(dataclasses.replace(load_quantized(gguf_model), rotary="half"))
    reference = LlamaStage(load_weights(gguf_model))
    got = wrong.logits(wrong.forward(wrong.embed(PROMPT), wrong.new_cache(64)))
    want = reference.logits(reference.forward(reference.embed(PROMPT), reference.new_cache(64)))
    with pytest.raises(AssertionError, match="beyond"):
        close_to_reference(got, want)


def test_the_matrices_are_views_of_the_file(gguf_model: Path) -> None:
    weights = load_quantized(gguf_model)
    layer = weights.layers[0]
    mapped = weights.keepalive.raw("blk.0.attn_q.weight")
    assert np.shares_memory(layer.wq.data, mapped)
    assert layer.wq.ggml_type == weights.keepalive.tensors["blk.0.attn_q.weight"].ggml_type
    assert layer.wq.ggml_type in (kernels.Q8_0, kernels.Q5_0)
    # The stage's bytes are the file's tensor bytes: nothing expanded.
    file_bytes = sum(info.nbytes for info in weights.keepalive.tensors.values())
    assert weights.nbytes == file_bytes


def test_split_stages_give_the_single_stage_bits(gguf_model: Path) -> None:
    whole = QuantizedStage(load_quantized(gguf_model))
    first = QuantizedStage(load_quantized(gguf_model, 0, 1))
    second = QuantizedStage(load_quantized(gguf_model, 1, 3))
    third = QuantizedStage(load_quantized(gguf_model, 3, 4))
    caches = [s.new_cache(64) for s in (whole, first, second, third)]
    hidden = whole.forward(whole.embed(PROMPT), caches[0])
    split = third.forward(second.forward(first.forward(first.embed(PROMPT), caches[1]),
                                         caches[2]), caches[3])
    assert np.array_equal(whole.logits(hidden), third.logits(split))
    token = [int(whole.logits(hidden[-1:])[0].argmax())]
    hidden = whole.forward_batch(whole.embed(token), [caches[0]])
    split = third.forward_batch(second.forward_batch(
        first.forward_batch(first.embed(token), [caches[1]]), [caches[2]]), [caches[3]])
    assert np.array_equal(hidden, split)


def test_a_sequence_has_the_same_bits_alone_and_in_any_batch(gguf_model: Path) -> None:
    stage = QuantizedStage(load_quantized(gguf_model))
    prompts = [PROMPT, PROMPT[:3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [11]]
    caches = [stage.new_cache(64) for _ in prompts]
    alone = [stage.new_cache(64) for _ in prompts]
    tokens = []
    for prompt, cache, solo in zip(prompts, caches, alone, strict=True):
        a = stage.forward(stage.embed(prompt), cache)
        b = stage.forward(stage.embed(prompt), solo)
        assert np.array_equal(a, b)
        tokens.append(int(stage.logits(a[-1:])[0].argmax()))
    batched = stage.forward_batch(stage.embed(tokens), caches)
    for row, (token, solo) in enumerate(zip(tokens, alone, strict=True)):
        single = stage.forward_batch(stage.embed([token]), [solo])
        assert np.array_equal(batched[row:row + 1], single)


def test_thread_counts_give_the_same_bits(gguf_model: Path) -> None:
    weights = load_quantized(gguf_model)
    outs = []
    for threads in (1, 2, 3):
        stage = QuantizedStage(weights, threads=lambda n=threads: n)
        outs.append(run(stage, PROMPT, 3)[0])
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert np.array_equal(a, b)


def test_random_models_quantize_for_the_engine() -> None:
    config = tiny_config(tied=False)
    floats = LlamaWeights.random(config, seed=8)
    weights = QuantizedWeights.from_float(floats)
    assert weights.layers[0].w_up.ggml_type == kernels.Q8_0
    # Quantizing to Q8_0 rounds weights too: a looser agreement than the file's.
    got, tokens = run(QuantizedStage(weights), PROMPT, 3)
    reference = LlamaStage(floats)
    want = reference.logits(reference.forward(reference.embed(PROMPT), reference.new_cache(64)))
    assert float(np.abs(got[0] - want[-1]).max()) <= 0.05 * float(np.abs(want).max())
    half = QuantizedWeights.from_float(floats.slice(0, 2))
    assert half.lm_head is None and half.embed_tokens is not None


def test_interleaved_rotary_is_half_rotary_on_permuted_rows() -> None:
    config = tiny_config()
    rng = np.random.default_rng(1)
    heads, hd = config.num_attention_heads, config.head_dim
    x = rng.standard_normal((5, heads, hd)).astype(np.float32)
    positions = np.arange(3, 8)
    half = Rotary(config, "half")(x, positions)
    # interleaved layout: element 2i is half-layout element i, 2i+1 is i + hd/2
    order = np.stack([np.arange(hd // 2), np.arange(hd // 2) + hd // 2], axis=1).reshape(-1)
    inter = Rotary(config, "interleaved")(x[..., order], positions)
    assert np.allclose(inter, half[..., order], atol=1e-6)


def test_misuse_is_refused_by_name(gguf_model: Path) -> None:
    first = QuantizedStage(load_quantized(gguf_model, 0, 2))
    with pytest.raises(PMetalValueError, match="not the last stage"):
        first.logits(np.zeros((1, 64), np.float32))
    last = QuantizedStage(load_quantized(gguf_model, 2, 4))
    with pytest.raises(PMetalValueError, match="not the first stage"):
        last.embed([1])
    with pytest.raises(PMetalValueError, match="token ids"):
        first.embed([10_000])
    with pytest.raises(PMetalValueError, match="float32"):
        first.forward(np.zeros((1, 64), np.float64), first.new_cache(8))
    with pytest.raises(PMetalValueError, match="KV cache"):
        first.forward(np.zeros((9, 64), np.float32), first.new_cache(8))
    with pytest.raises(PMetalValueError, match="max_threads"):
        QuantizedStage(load_quantized(gguf_model), max_threads=0)
