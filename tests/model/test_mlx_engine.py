"""GGUF blocks in MLX's affine quantization, and the MLX engine on them.

The conversion is checked value by value against ``gguf``'s own
dequantizer: exactly for every type with an MLX equivalent, within float16
rounding for Q6_K (pmetal.model.mlxblocks says why)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from pmetal.errors import PMetalValueError
from pmetal.model import kernels
from pmetal.model.config import LlamaConfig
from pmetal.model.kernels import KernelError, QMatrix
from pmetal.model.mlxblocks import Affine, Dense, convert, pack
from pmetal.model.quantized import QuantizedStage, QuantizedWeights
from pmetal.pipeline.llama import LlamaStage, LlamaWeights
from pmetal.pipeline.loader import load_quantized, load_weights
from tests.pipeline.kquants import T, quantize, random_blocks
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf

mx = pytest.importorskip(
    "mlx.core", reason="mlx is not installed (pip install mlx, or 'mlx[cpu]' on Linux): "
                       "the MLX engine is not tested")
from pmetal.model.mlx import MlxQuantizedStage  # after the skip: it needs mlx

ROWS, COLS = 24, 512


def as_float32(converted: Affine | Dense) -> np.ndarray:
    """What MLX's products see: ``scale * q + bias`` by ``mx.dequantize``."""
    if isinstance(converted, Dense):
        array = mx.array(converted.array)
        if converted.bfloat16:
            array = array.view(mx.bfloat16)
        return np.array(array.astype(mx.float32))
    return np.array(mx.dequantize(mx.array(converted.w),
                                  mx.array(converted.scales.astype(np.float32)),
                                  mx.array(converted.biases.astype(np.float32)),
                                  group_size=32, bits=converted.bits))


def blocks(kind: T, rng: np.random.Generator) -> np.ndarray:
    if kind in (T.Q4_K, T.Q5_K, T.Q6_K):
        return random_blocks(kind, ROWS, COLS, rng)
    return quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), kind)


def reference(data: np.ndarray, kind: T) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(data, kind).reshape(ROWS, COLS).astype(np.float32)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_codes_are_packed_as_mlx_reads_them(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (3, 64), dtype=np.uint8)
    ones = mx.ones((3, 2))
    got = mx.dequantize(mx.array(pack(codes, bits)), ones, mx.zeros((3, 2)), group_size=32,
                        bits=bits)
    assert np.array_equal(np.array(got), codes.astype(np.float32))


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.F16,
                                  T.BF16, T.F32], ids=lambda k: k.name)
def test_exact_types_convert_to_the_same_values(kind: T) -> None:
    rng = np.random.default_rng(int(kind))
    data = blocks(kind, rng)
    converted = convert(QMatrix(data, int(kind), ROWS, COLS))
    assert converted.exact
    assert np.array_equal(as_float32(converted), reference(data, kind))


@pytest.mark.parametrize("kind", [T.Q5_0, T.Q5_1], ids=lambda k: k.name)
def test_q5_blocks_of_random_bytes_convert_exactly(kind: T) -> None:
    """Every pattern of fifth bits, not only what gguf's quantizer writes."""
    data = random_blocks(kind, ROWS, COLS, np.random.default_rng(int(kind)))
    converted = convert(QMatrix(data, int(kind), ROWS, COLS))
    assert isinstance(converted, Affine) and converted.bits == 5
    assert np.array_equal(as_float32(converted), reference(data, kind))


def test_scales_are_float16_where_that_is_exact() -> None:
    rng = np.random.default_rng(5)
    for kind, bits, scale_type in ((T.Q4_0, 4, np.float16), (T.Q4_1, 4, np.float16),
                                   (T.Q5_0, 5, np.float16), (T.Q5_1, 5, np.float16),
                                   (T.Q8_0, 8, np.float16), (T.Q4_K, 4, np.float32),
                                   (T.Q5_K, 5, np.float32)):
        converted = convert(QMatrix(blocks(kind, rng), int(kind), ROWS, COLS))
        assert isinstance(converted, Affine)
        assert (converted.bits, converted.scales.dtype, converted.biases.dtype) == (
            bits, scale_type, scale_type), kind.name
        assert converted.w.dtype == np.uint32 and converted.w.shape == (ROWS, COLS * bits // 32)


def test_q6_k_is_float16_within_its_rounding() -> None:
    rng = np.random.default_rng(6)
    for data in (random_blocks(T.Q6_K, ROWS, COLS, rng),
                 quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), T.Q6_K)):
        converted = convert(QMatrix(data, kernels.Q6_K, ROWS, COLS))
        assert isinstance(converted, Dense) and converted.array.dtype == np.float16
        assert not converted.exact
        want = reference(data, T.Q6_K)
        # half an ulp of float16: 2**-11 of the value, 2**-25 among subnormals
        bound = np.abs(want) * 2.0 ** -11 + 2.0 ** -25
        assert np.all(np.abs(as_float32(converted) - want) <= bound)


def test_a_type_the_engines_do_not_read_is_refused_by_name() -> None:
    """Q2_K and the other types without a kernel: a matrix of one is
    refused where it is loaded, naming the type and what is supported."""
    data = random_blocks(T.Q2_K, ROWS, COLS, np.random.default_rng(8))
    with pytest.raises(KernelError, match="ggml type 10 is not supported.*Q5_0, Q5_1"):
        QMatrix(data, int(T.Q2_K), ROWS, COLS)


def test_q6_k_float16_beats_8_bit_requantization() -> None:
    """The measurement behind the Q6_K choice (docs/pipeline.md): RMS
    errors of 2.0e-4 and 4.8e-3 of the weights' RMS."""
    import gguf

    rng = np.random.default_rng(7)
    weights = (rng.standard_normal((256, 1024)) * 0.02).astype(np.float32)
    want = gguf.quants.dequantize(quantize(weights, T.Q6_K), T.Q6_K).reshape(weights.shape)
    rms = float(np.sqrt(np.mean(want ** 2)))
    half = float(np.sqrt(np.mean((want.astype(np.float16).astype(np.float32) - want) ** 2)))
    w, scales, biases = mx.quantize(mx.array(want), group_size=32, bits=8)
    eight = np.array(mx.dequantize(w, scales, biases, group_size=32, bits=8))
    requantized = float(np.sqrt(np.mean((eight - want) ** 2)))
    assert half / rms < 3e-4 and requantized / rms > 3e-3, (half / rms, requantized / rms)



# ---------------------------------------------------------------- the engine
#
# Against the float32 reference decoder on the same file (dequantized by
# gguf). Where every matrix converts exactly the two compute the same
# weights in float32 in different orders (MLX's fused kernels): measured
# ~1e-6 of the logits' scale. Where Q6_K or F16 matrices multiply in float16
# (weights and inputs rounded to 2**-11): measured ~9e-4. Where bfloat16
# matrices multiply in bfloat16 (inputs rounded to 2**-8): measured ~1.3e-2.
EXACT = 2e-4
MIXED = 3e-3
BFLOAT16 = 3e-2
# Every type once, and neighbours that cannot share a product (q/k/v, gate/up).
MIXED_TYPES = {"token_embd": T.BF16, "attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K,
               "attn_output": T.Q4_0, "ffn_gate": T.Q4_1, "ffn_up": T.Q5_K,
               "ffn_down": T.Q6_K, "output": T.F16}
PROMPT = [5, 17, 42, 9, 100, 3, 77]


@dataclass(frozen=True)
class Model:
    path: Path
    tolerance: float  # of the logits' scale, against the reference
    growth: float     # the most bytes in MLX over bytes in the file


# Q5_0 and Q5_1, as Q4_K_M/Q5_K_M files keep them for rows not a multiple of
# 256, with Q8_0: every matrix converts exactly.
Q5_TYPES = {"token_embd": T.Q5_1, "attn_q": T.Q5_0, "attn_k": T.Q5_1, "attn_v": T.Q8_0,
            "attn_output": T.Q5_1, "ffn_gate": T.Q5_0, "ffn_up": T.Q5_1, "ffn_down": T.Q5_0,
            "output": T.Q5_0}


@pytest.fixture(scope="module", params=["q8_0-tied", "q8_0-untied", "mixed", "bf16", "q5"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = tmp_path_factory.mktemp("mlx") / f"{request.param}.gguf"
    if request.param == "mixed":  # K quants need rows of 256
        config = LlamaConfig(**{**tiny_config(tied=False).__dict__, "hidden_size": 256,
                                "intermediate_size": 512, "head_dim": 64})
        write_tiny_gguf(path, config, seed=3, types=MIXED_TYPES)
        return Model(path, MIXED, 2.0)  # Q6_K as float16: 2.4x its bytes (measured 1.5x)
    if request.param == "bf16":
        names = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                 "ffn_up", "ffn_down")
        write_tiny_gguf(path, tiny_config(), seed=3, types=dict.fromkeys(names, T.BF16))
        return Model(path, BFLOAT16, 1.0)
    if request.param == "q5":
        write_tiny_gguf(path, tiny_config(tied=False), seed=3, types=Q5_TYPES)
        return Model(path, EXACT, 1.1)  # 6 bits a weight, 5.5-6 in the file
    write_tiny_gguf(path, tiny_config(tied=request.param.endswith("-tied")), seed=3,
                    quantize=True)
    return Model(path, EXACT, 1.1)  # Q8_0: 9 bits a weight, 8.5 in the file


def close(got: np.ndarray, want: np.ndarray, tolerance: float) -> None:
    scale = float(np.abs(want).max())
    error = float(np.abs(got - want).max())
    assert error <= tolerance * scale, f"error {error:.3g} beyond {tolerance} of {scale:.3g}"


def test_the_engine_agrees_with_the_reference_on_the_same_file(model: Model) -> None:
    engine = MlxQuantizedStage(load_quantized(model.path))
    reference = LlamaStage(load_weights(model.path))
    assert np.array_equal(engine.embed(PROMPT), reference.embed(PROMPT))  # exact rows
    ours, theirs = engine.new_cache(64), reference.new_cache(64)
    # a prefill continued on a filled cache: the causal mask's offset
    for chunk in (PROMPT[:4], PROMPT[4:]):
        want = reference.logits(reference.forward(reference.embed(chunk), theirs))
        close(engine.logits(engine.forward(engine.embed(chunk), ours)), want, model.tolerance)
    for _ in range(5):
        token = [int(want[-1].argmax())]  # both follow the reference's tokens
        want = reference.logits(reference.forward_batch(reference.embed(token), [theirs]))
        got = engine.logits(engine.forward_batch(engine.embed(token), [ours]))
        close(got, want, model.tolerance)
    assert ours.length == theirs.length == len(PROMPT) + 5


def test_split_stages_agree_with_one_stage(model: Model) -> None:
    whole = MlxQuantizedStage(load_quantized(model.path))
    first = MlxQuantizedStage(load_quantized(model.path, 0, 2))
    second = MlxQuantizedStage(load_quantized(model.path, 2, 4))
    caches = [s.new_cache(64) for s in (whole, first, second)]
    hidden = whole.forward(whole.embed(PROMPT), caches[0])
    split = second.forward(first.forward(first.embed(PROMPT), caches[1]), caches[2])
    close(second.logits(split), whole.logits(hidden), 1e-5)
    for _ in range(3):
        token = [int(whole.logits(hidden[-1:])[0].argmax())]
        hidden = whole.forward_batch(whole.embed(token), [caches[0]])
        split = second.forward_batch(first.forward_batch(first.embed(token), [caches[1]]),
                                     [caches[2]])
        close(second.logits(split), whole.logits(hidden), 1e-5)


def test_a_sequence_agrees_alone_and_in_a_batch(model: Model) -> None:
    stage = MlxQuantizedStage(load_quantized(model.path))
    prompts = [PROMPT, PROMPT[:3], [9, 8, 7, 6, 5, 4, 3, 2, 1], [11]]
    caches = [stage.new_cache(64) for _ in prompts]
    alone = [stage.new_cache(64) for _ in prompts]
    tokens = []
    for prompt, cache, solo in zip(prompts, caches, alone, strict=True):
        hidden = stage.forward(stage.embed(prompt), cache)
        stage.forward(stage.embed(prompt), solo)
        tokens.append(int(stage.logits(hidden[-1:])[0].argmax()))
    batched = stage.logits(stage.forward_batch(stage.embed(tokens), caches))
    for row, (token, solo) in enumerate(zip(tokens, alone, strict=True)):
        single = stage.logits(stage.forward_batch(stage.embed([token]), [solo]))
        close(batched[row:row + 1], single, 1e-5)
    assert [c.length for c in caches] == [len(p) + 1 for p in prompts]


def test_the_stage_holds_no_float32_copy_of_a_quantized_matrix(model: Model) -> None:
    weights = load_quantized(model.path)
    stage = MlxQuantizedStage(weights)
    kinds = {id(m): m.ggml_type for layer in weights.layers for m in layer.matrices()}
    assert kernels.F32 not in kinds.values()  # so float32 may only be scales
    for matrix in stage.matrices():
        weights_count = matrix.rows * matrix.cols
        if matrix.bits is None:
            assert matrix.dense.dtype in (mx.float16, mx.bfloat16)
            assert matrix.nbytes == 2 * weights_count
        else:
            assert matrix.w.dtype == mx.uint32
            assert matrix.w.nbytes * 8 == weights_count * matrix.bits
            assert matrix.scales.dtype in (mx.float16, mx.float32)
            assert matrix.scales.size == matrix.biases.size == weights_count // 32
    # float32 matrices would be 3.8x the file (Q8_0) or more
    assert stage.nbytes <= model.growth * weights.nbytes, stage.nbytes / weights.nbytes


def test_a_tied_head_is_the_embedding_held_once(model: Model) -> None:
    weights = load_quantized(model.path)
    stage = MlxQuantizedStage(weights)
    tied = weights.lm_head is weights.embed_tokens
    tables = [m for m in stage.matrices() if m.rows == weights.config.vocab_size]
    assert len(tables) == (1 if tied else 2)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_qwen_biases_and_head_norms_match_the_quantized_engine(architecture: str) -> None:
    llama = tiny_config()
    # The architecture implies the biases (qwen2) or the head norms (qwen3).
    config = LlamaConfig(**{**llama.__dict__, "architecture": architecture})
    rng = np.random.default_rng(9)
    plain = QuantizedWeights.from_float(LlamaWeights.random(llama, seed=9))

    def vector(size: int, around: float) -> np.ndarray:
        return (around + 0.5 * rng.standard_normal(size)).astype(np.float32)

    def extra() -> dict[str, np.ndarray]:
        if architecture == "qwen2":
            return {"q_bias": vector(config.q_size, 0), "k_bias": vector(config.kv_size, 0),
                    "v_bias": vector(config.kv_size, 0)}
        return {"q_norm": vector(config.head_dim, 1), "k_norm": vector(config.head_dim, 1)}

    weights = replace(plain, config=config,
                      layers=tuple(replace(layer, **extra()) for layer in plain.layers))
    got = run(MlxQuantizedStage(weights))
    # The numpy engine's kernels round activations to 8 bits: ~1% (test_quantized.py).
    for ours, theirs in zip(got, run(QuantizedStage(weights)), strict=True):
        close(ours, theirs, 0.03)
    # ... and without the extra vectors the logits move far more than that
    without = run(MlxQuantizedStage(plain))[0]
    assert np.abs(without - got[0]).max() > 0.1 * np.abs(got[0]).max()


def run(stage: MlxQuantizedStage | QuantizedStage) -> list[np.ndarray]:
    """Prefill, then three greedy steps: every step's last logits."""
    cache = stage.new_cache(64)
    logits = [stage.logits(stage.forward(stage.embed(PROMPT), cache))[-1]]
    for _ in range(3):
        hidden = stage.forward_batch(stage.embed([int(logits[-1].argmax())]), [cache])
        logits.append(stage.logits(hidden)[0])
    return logits


def test_misuse_is_refused_by_name(model: Model) -> None:
    first = MlxQuantizedStage(load_quantized(model.path, 0, 2))
    hidden = first.config.hidden_size
    with pytest.raises(PMetalValueError, match="not the last stage"):
        first.logits(np.zeros((1, hidden), np.float32))
    with pytest.raises(PMetalValueError, match="not the first stage"):
        MlxQuantizedStage(load_quantized(model.path, 2, 4)).embed([1])
    with pytest.raises(PMetalValueError, match="token ids"):
        first.embed([10_000])
    with pytest.raises(PMetalValueError, match="float32"):
        first.forward(np.zeros((1, hidden), np.float64), first.new_cache(8))
    with pytest.raises(PMetalValueError, match="KV cache"):
        first.forward(np.zeros((9, hidden), np.float32), first.new_cache(8))
    cache = first.new_cache(8)
    with pytest.raises(PMetalValueError, match="twice"):
        first.forward_batch(np.zeros((2, hidden), np.float32), [cache, cache])
