"""The MLX decoder against the numpy one, and the backend choice.

Tolerance: both compute in float32 but in different orders (MLX's fused
rms_norm, rope and attention kernels, its own GEMM); each is within 1e-4
of its scale of the float64 reference (test_llama.py), so they are within
2e-4 of each other; measured on the tiny model: about 1e-6."""

from __future__ import annotations

import numpy as np
import pytest

from pmetal.pipeline.llama import LlamaConfig, LlamaStage, LlamaWeights
from pmetal.pipeline.llama_mlx import MlxLlamaStage, mlx_available

TINY = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                   rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                   bos_token_id=1, eos_token_id=2)
PROMPT = [1, 17, 42, 5, 99, 3, 64]
TOLERANCE = 2e-4

needs_mlx = pytest.mark.skipif(not mlx_available(),
                               reason="mlx is not installed (pip install mlx, or "
                                      "'mlx[cpu]' on Linux): the MLX backend is not tested")


def close(ours: np.ndarray, ref: np.ndarray) -> None:
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= TOLERANCE * scale, np.abs(ours - ref).max() / scale


@needs_mlx
@pytest.mark.parametrize("tied", [True, False])
def test_mlx_stage_matches_numpy_for_prefill_decode_and_batches(tied: bool) -> None:
    weights = LlamaWeights.random(
        LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": tied}), seed=3)
    ref, mlx = LlamaStage(weights), MlxLlamaStage(weights)
    np.testing.assert_array_equal(mlx.embed(PROMPT), ref.embed(PROMPT))
    prompts = [PROMPT, PROMPT[:2], [5, 6, 7, 8, 9]]
    ref_caches = [ref.new_cache(32) for _ in prompts]
    mlx_caches = [mlx.new_cache(32) for _ in prompts]
    tokens = []
    for prompt, rc, mc in zip(prompts, ref_caches, mlx_caches):
        r = ref.logits(ref.forward(ref.embed(prompt[:3]), rc))
        m = mlx.logits(mlx.forward(mlx.embed(prompt[:3]), mc))
        close(m, r)
        if prompt[3:]:  # a prefill continued on a filled cache: the causal mask's offset
            r = ref.logits(ref.forward(ref.embed(prompt[3:]), rc))
            close(mlx.logits(mlx.forward(mlx.embed(prompt[3:]), mc)), r)
        tokens.append(int(r[-1].argmax()))
    for _ in range(4):
        r = ref.logits(ref.forward_batch(ref.embed(tokens), ref_caches))
        m = mlx.logits(mlx.forward_batch(mlx.embed(tokens), mlx_caches))
        close(m, r)
        assert [int(t) for t in m.argmax(-1)] == [int(t) for t in r.argmax(-1)]
        tokens = [int(t) for t in r.argmax(-1)]
    assert [c.length for c in mlx_caches] == [c.length for c in ref_caches] == [11, 6, 9]


@needs_mlx
def test_mlx_stages_split_like_numpy_stages() -> None:
    weights = LlamaWeights.random(TINY, seed=4)
    first, second = MlxLlamaStage(weights.slice(0, 2)), MlxLlamaStage(weights.slice(2, 4))
    ref = LlamaStage(weights)
    hidden = second.forward(first.forward(first.embed(PROMPT), first.new_cache(16)),
                            second.new_cache(16))
    assert hidden.dtype == np.float32 and hidden.shape == (len(PROMPT), TINY.hidden_size)
    close(second.logits(hidden), ref.logits(ref.forward(ref.embed(PROMPT), ref.new_cache(16))))
