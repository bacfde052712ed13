"""GGUF blocks in MLX's affine quantization, and the MLX engine on them.

The conversion is checked value by value against ``gguf``'s own
dequantizer: exactly for every type with an MLX equivalent, within float16
rounding for Q6_K (pmetal.model.mlxblocks says why)."""

from __future__ import annotations

import numpy as np
import pytest

from pmetal.model import kernels
from pmetal.model.kernels import QMatrix
from pmetal.model.mlxblocks import Affine, Dense, convert, pack
from tests.pipeline.kquants import T, quantize, random_blocks

mx = pytest.importorskip(
    "mlx.core", reason="mlx is not installed (pip install mlx, or 'mlx[cpu]' on Linux): "
                       "the MLX engine is not tested")

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


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.F16, T.BF16, T.F32],
                         ids=lambda k: k.name)
def test_exact_types_convert_to_the_same_values(kind: T) -> None:
    rng = np.random.default_rng(int(kind))
    data = blocks(kind, rng)
    converted = convert(QMatrix(data, int(kind), ROWS, COLS))
    assert converted.exact
    assert np.array_equal(as_float32(converted), reference(data, kind))


def test_scales_are_float16_where_that_is_exact() -> None:
    rng = np.random.default_rng(5)
    for kind, bits, scale_type in ((T.Q4_0, 4, np.float16), (T.Q4_1, 4, np.float16),
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


def test_other_types_become_float16_as_gguf_decodes_them() -> None:
    data = quantize(np.random.default_rng(8).standard_normal((ROWS, COLS)).astype(np.float32),
                    T.Q5_0)
    converted = convert(QMatrix(data, int(T.Q5_0), ROWS, COLS))
    assert isinstance(converted, Dense) and not converted.exact
    want = reference(data, T.Q5_0)
    assert np.all(np.abs(as_float32(converted) - want) <= np.abs(want) * 2.0 ** -11 + 2.0 ** -25)


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

