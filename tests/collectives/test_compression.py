"""Gradient compression: codecs, error feedback, reduction and a miniature
data-parallel training run (the collectives issue's Done-when, in numpy)."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pmetal.collectives
from pmetal.collectives import compression
from pmetal.collectives.compression import (
    CompressionConfig,
    CompressionStatistics,
    CompressionStrategy,
    GradientCompressor,
    QuantizationType,
    aggregate,
    decompress,
)
from pmetal.collectives.compression.codecs import bf16_decode, bf16_encode
from pmetal.errors import PMetalTypeError, PMetalValueError

S = CompressionStrategy
LOSSY = [s for s in S if s.lossy]
DTYPES = [np.float16, np.float32, np.float64]
SHAPES = [(0,), (1,), (7,), (3, 0), (33, 65), (3, 4, 5)]


def compressor(strategy: CompressionStrategy, **kw: object) -> GradientCompressor:
    return GradientCompressor(CompressionConfig(strategy=strategy, **kw))  # type: ignore[arg-type]


def work(dtype: np.dtype) -> type[np.floating]:
    return np.float64 if dtype == np.float64 else np.float32


# -- surface and configuration ------------------------------------------------

def test_public_names_are_sorted_and_exported() -> None:
    assert compression.__all__ == sorted(compression.__all__)
    for name in compression.__all__:
        assert getattr(pmetal.collectives, name) is getattr(compression, name)


def test_every_quantization_type_is_a_strategy() -> None:
    assert [q.strategy for q in QuantizationType] == [S.FP16, S.BF16, S.INT8, S.ONE_BIT]
    assert {s for s in S if s.quantization} == {q.strategy for q in QuantizationType}
    assert S.TOPK.quantization is None


@pytest.mark.parametrize(("field", "value", "error", "says"), [
    ("strategy", "topk", PMetalTypeError, "must be a CompressionStrategy"),
    ("ratio", 0.0, PMetalValueError, "fraction in (0, 1]"),
    ("ratio", 1.5, PMetalValueError, "fraction in (0, 1]"),
    ("ratio", True, PMetalValueError, "fraction in (0, 1]"),
    ("rank", 0, PMetalValueError, "rank must be an integer >= 1"),
    ("chunk_size", 0, PMetalValueError, "chunk_size must be an integer >= 1"),
    ("seed", -1, PMetalValueError, "seed must be an integer >= 0"),
])
def test_config_refuses_bad_values(field: str, value: object, error: type, says: str) -> None:
    with pytest.raises(error, match=re_escape(says)):
        CompressionConfig(**{field: value})  # type: ignore[arg-type]


def re_escape(text: str) -> str:
    import re
    return re.escape(text)


def test_config_is_frozen_and_compressor_wants_one() -> None:
    config = CompressionConfig(strategy=S.TOPK)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ratio = 0.5  # type: ignore[misc]
    with pytest.raises(PMetalTypeError, match="takes a CompressionConfig"):
        GradientCompressor(S.TOPK)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [[1.0, 2.0], np.arange(4), np.ones(3, dtype=np.complex64)])
def test_only_floating_arrays_are_compressed(bad: object) -> None:
    with pytest.raises(PMetalTypeError, match="gradient 'g'"):
        compressor(S.INT8).compress("g", bad)


# -- round trips ----------------------------------------------------------------

@pytest.mark.parametrize("strategy", list(S))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_keeps_shape_and_dtype(strategy: CompressionStrategy, dtype: type,
                                          shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    c = compressor(strategy, ratio=0.1, rank=2, chunk_size=16).compress("g", x)
    y = decompress(c)
    assert (y.shape, y.dtype) == (x.shape, x.dtype)
    assert np.isfinite(y).all()
    assert c.nbytes == sum(a.nbytes for a in (c.values, c.indices, c.scales, c.factor)
                           if a is not None)
    if strategy is S.NONE:
        assert np.array_equal(y, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_cases_are_exact(dtype: type) -> None:
    x = np.random.default_rng(2).standard_normal(100).astype(dtype)
    assert np.array_equal(decompress(compressor(S.TOPK, ratio=1.0).compress("g", x)), x)
    assert np.array_equal(decompress(compressor(S.RANDOM_K, ratio=1.0).compress("g", x)), x)
    if dtype == np.float16:
        assert np.array_equal(decompress(compressor(S.FP16).compress("g", x)), x)


def test_fp16_relative_error_and_clipping() -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(10_000) * 10.0 ** rng.uniform(-4, 4, 10_000)).astype(np.float32)
    y = decompress(compressor(S.FP16).compress("g", x))
    # Half an ulp: 2**-11 relative in the normal range, 2**-25 among subnormals.
    assert np.all(np.abs(y - x) <= np.maximum(np.abs(x) * 2.0 ** -11, 2.0 ** -25))
    big = compressor(S.FP16)
    out = decompress(big.compress("g", np.array([1e6, -1e6], dtype=np.float32)))
    assert out.tolist() == [65504.0, -65504.0]  # clipped, not inf
    residual = big.residual("g")
    assert residual is not None and residual.tolist() == [1e6 - 65504.0, -(1e6 - 65504.0)]


def test_bf16_relative_error_ties_to_even_and_clips() -> None:
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(10_000) * 10.0 ** rng.uniform(-20, 20, 10_000)).astype(np.float32)
    y = decompress(compressor(S.BF16).compress("g", x))
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0 ** -8)
    # bfloat16 keeps 7 mantissa bits: the ulp at 1 is 2**-7. Halfway cases go
    # to the even neighbour; truncation would always go down.
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 3 * 2.0 ** -8)], dtype=np.float32)
    assert bf16_decode(bf16_encode(ties)).tolist() == [1.0, 1 + 2.0 ** -6, -(1 + 2.0 ** -6)]
    assert bf16_decode(bf16_encode(np.array([1 + 2.0 ** -8 + 2.0 ** -20],
                                            dtype=np.float32))).tolist() == [1 + 2.0 ** -7]
    special = bf16_decode(bf16_encode(np.array([np.inf, -np.inf, np.nan, -0.0], np.float32)))
    assert special[0] == np.inf and special[1] == -np.inf and np.isnan(special[2])
    assert np.signbit(special[3])
    huge = decompress(compressor(S.BF16).compress("g", np.array([1e300, -1e300])))
    assert np.isfinite(huge).all() and huge[0] > 3e38


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 64),
                  elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
def test_bf16_matches_mlx_rounding(x: np.ndarray) -> None:
    mx = pytest.importorskip("mlx.core")
    finite = np.abs(x) <= compression.codecs.BF16_MAX
    expected = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    ours = bf16_decode(bf16_encode(x))
    assert np.array_equal(ours[finite], expected[finite])


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float64, st.integers(0, 300),
                  elements=st.floats(-1e6, 1e6, allow_nan=False)),
       st.integers(1, 64))
def test_int8_error_is_at_most_half_a_scale(x: np.ndarray, chunk: int) -> None:
    c = compressor(S.INT8, chunk_size=chunk).compress("g", x)
    assert c.values.dtype == np.int8 and c.scales is not None
    assert c.scales.dtype == np.float64 and c.scales.size == -(-x.size // chunk)
    scale = np.repeat(c.scales, chunk)[:x.size]
    # Rounding: within half a step (plus float slack); truncation allows a whole step.
    assert np.all(np.abs(decompress(c) - x) <= scale / 2 * (1 + 1e-9))


def test_int8_rounds_and_survives_all_zero_chunks() -> None:
    with np.errstate(all="raise"):  # a division by zero would raise here
        x = np.array([127.0, 0.6, 0.4, -0.6, 0, 0, 0, 0], dtype=np.float32)
        c = compressor(S.INT8, chunk_size=4).compress("g", x)
        assert c.values.tolist() == [127, 1, 0, -1, 0, 0, 0, 0]
        assert c.scales is not None and c.scales.tolist() == [1.0, 0.0]
        assert np.array_equal(decompress(c), [127, 1, 0, -1, 0, 0, 0, 0])
        zeros = compressor(S.INT8).compress("z", np.zeros((3, 3), dtype=np.float16))
        assert not decompress(zeros).any()


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 200), elements=st.floats(-100, 100, width=32)),
       st.integers(1, 50))
def test_one_bit_is_sign_times_mean_magnitude_per_chunk(x: np.ndarray, chunk: int) -> None:
    c = compressor(S.ONE_BIT, chunk_size=chunk).compress("g", x)
    assert c.values.dtype == np.uint8 and c.values.size == -(-x.size // 8)
    assert c.nbytes == -(-x.size // 8) + 4 * -(-x.size // chunk)
    expected = np.empty_like(x)
    for start in range(0, x.size, chunk):
        part = x[start:start + chunk]
        mean = np.float32(np.abs(part).mean())
        expected[start:start + chunk] = np.where(part >= 0, mean, -mean)
    assert np.allclose(decompress(c), expected, rtol=1e-5, atol=0)


def test_one_bit_sends_over_30_times_fewer_bytes_for_float32() -> None:
    c = compressor(S.ONE_BIT).compress("g", np.ones(1 << 20, dtype=np.float32))
    assert 4 * (1 << 20) / c.nbytes == pytest.approx(32 / (1 + 32 / 4096))  # 31.75


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 500), st.floats(0.001, 1.0), st.integers(0, 2**32 - 1))
def test_topk_keeps_exactly_the_k_largest_magnitudes(n: int, ratio: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.permutation(n) + 1.0) * rng.choice([-1.0, 1.0], n)  # distinct magnitudes
    c = compressor(S.TOPK, ratio=ratio).compress("g", x)
    k = min(n, max(1, math.ceil(ratio * n)))
    assert c.indices is not None and c.indices.dtype == np.int32
    assert c.indices.tolist() == sorted(np.argsort(-np.abs(x))[:k].tolist())
    assert np.array_equal(c.values, x[c.indices])
    assert c.nbytes == 12 * k  # float64 value + int32 index


def test_random_k_is_seeded_alike_on_every_rank_and_changes_per_step() -> None:
    x = np.arange(1000, dtype=np.float32)
    ranks = [compressor(S.RANDOM_K, ratio=0.05, seed=7) for _ in range(3)]
    first = [r.compress("g", x).indices.tolist() for r in ranks]  # type: ignore[union-attr]
    second = [r.compress("g", x).indices.tolist() for r in ranks]  # type: ignore[union-attr]
    assert first[0] == first[1] == first[2] and second[0] == second[1] == second[2]
    assert first[0] != second[0] and len(first[0]) == 50
    other = compressor(S.RANDOM_K, ratio=0.05, seed=8).compress("g", x)
    assert other.indices.tolist() != first[0]  # type: ignore[union-attr]


def test_random_k_without_feedback_is_unbiased_and_with_it_unscaled() -> None:
    x = np.random.default_rng(5).uniform(1, 2, 50)
    plain = compressor(S.RANDOM_K, ratio=0.1, error_feedback=False)
    draws = 4000
    mean = sum(decompress(plain.compress("g", x)) for _ in range(draws)) / draws
    # Each coordinate is x * 10 with probability 1/10: std of the mean is 3x/sqrt(draws).
    assert np.all(np.abs(mean - x) <= 5 * 3 * x / math.sqrt(draws))
    c = compressor(S.RANDOM_K, ratio=0.1).compress("g", x)
    assert np.array_equal(c.values, x[c.indices])


# -- non-finite values, shapes, state ---------------------------------------------

@pytest.mark.parametrize("strategy", LOSSY)
def test_nan_and_inf_are_refused_without_touching_state(strategy: CompressionStrategy) -> None:
    comp = compressor(strategy, ratio=0.1, rank=1)
    x = np.random.default_rng(6).standard_normal((8, 8)).astype(np.float32)
    comp.compress("g", x)
    before, stats = comp.residual("g"), comp.statistics()
    for bad in (np.nan, np.inf, -np.inf):
        poisoned = x.copy()
        poisoned[3, 3] = bad
        with pytest.raises(PMetalValueError, match="NaN or inf.*skip this step"):
            comp.compress("g", poisoned)
    after = comp.residual("g")
    assert comp.statistics() == stats
    assert (before is None and after is None) or np.array_equal(before, after)  # type: ignore[arg-type]
    assert np.isfinite(decompress(comp.compress("g", x))).all()


def test_overflowing_error_feedback_is_refused_and_reset_recovers() -> None:
    comp = compressor(S.FP16)
    x = np.array([3e38, 1.0], dtype=np.float32)
    assert decompress(comp.compress("g", x)).tolist() == [65504.0, 1.0]
    owed = comp.residual("g")
    with pytest.raises(PMetalValueError, match=r"overflows float32.*reset\('g'\)"):
        comp.compress("g", x)  # 3e38 + (3e38 - 65504) is beyond float32
    assert np.array_equal(comp.residual("g"), owed)  # type: ignore[arg-type]
    comp.reset("g")
    assert np.isfinite(decompress(comp.compress("g", x))).all()
    # A float16 gradient's float32 residual can exceed float16: values are
    # clipped on the wire and error feedback keeps the rest.
    half = compressor(S.TOPK, ratio=0.5)
    for _ in range(4):
        assert np.isfinite(decompress(half.compress("h", np.full(2, 60000, np.float16)))).all()
    assert half.residual("h").max() > 65504  # type: ignore[union-attr]


# Values up to each dtype's maximum overflow inside numpy on purpose: the
# compressor must refuse them cleanly, and numpy's warnings on the way say
# nothing this test does not check.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@settings(max_examples=300, deadline=None)
@given(st.sampled_from(LOSSY), st.sampled_from(DTYPES),
       hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=9), st.data())
def test_any_finite_input_gives_finite_output_or_a_clear_refusal(
        strategy: CompressionStrategy, dtype: type, shape: tuple[int, ...],
        data: st.DataObject) -> None:
    """Magnitudes up to the dtype's maximum never put inf on the wire or in
    a residual: either the step is refused with an overflow error and the
    state stays as it was, or everything is finite."""
    width = np.dtype(dtype).itemsize * 8
    x = data.draw(hnp.arrays(dtype, shape, elements=st.floats(
        width=width, allow_nan=False, allow_infinity=False)))  # type: ignore[arg-type]
    comp = compressor(strategy, ratio=0.3, rank=1, chunk_size=4)
    for _ in range(3):
        owed = comp.residual("g")
        try:
            sent = decompress(comp.compress("g", x))
        except PMetalValueError as exc:
            assert "overflow" in str(exc)
            now = comp.residual("g")
            assert (owed is None and now is None) or np.array_equal(owed, now)  # type: ignore[arg-type]
            continue
        assert np.isfinite(sent).all()
        residual = comp.residual("g")
        assert residual is None or np.isfinite(residual).all()


def test_none_passes_non_finite_values_through() -> None:
    x = np.array([np.nan, np.inf, 1.0])
    assert np.array_equal(decompress(compressor(S.NONE).compress("g", x)), x, equal_nan=True)


def test_a_tensor_that_changes_shape_needs_a_reset() -> None:
    comp = compressor(S.TOPK)
    comp.compress("g", np.ones(10, dtype=np.float32))
    with pytest.raises(PMetalValueError, match=r"was \(10,\) float32 and is now \(11,\).*reset"):
        comp.compress("g", np.ones(11, dtype=np.float32))
    comp.reset("g")
    assert comp.residual("g") is None
    comp.compress("g", np.ones(11, dtype=np.float32))


def test_statistics_count_bytes_in_and_out() -> None:
    comp = compressor(S.POWERSGD, rank=2)
    assert comp.statistics() == CompressionStatistics(S.POWERSGD, 0, 0, 0, 0)
    assert comp.statistics().ratio == 1.0
    comp.compress("w", np.ones((100, 50), dtype=np.float32))
    comp.compress("b", np.ones(50, dtype=np.float32))
    stats = comp.statistics()
    assert (stats.tensors, stats.uncompressed) == (2, 1)
    assert stats.bytes_in == 4 * (5000 + 50)
    assert stats.bytes_out == 4 * 2 * (100 + 50) + 4 * 50
    assert stats.ratio == pytest.approx(stats.bytes_in / stats.bytes_out)


# -- error feedback -------------------------------------------------------------

@pytest.mark.parametrize("strategy", LOSSY)
def test_error_feedback_tracks_the_sum_of_inputs(strategy: CompressionStrategy) -> None:
    """Over T steps, sum(sent) = sum(inputs) - final residual, and the
    residual stays bounded, so what is sent converges to what was given."""
    rng = np.random.default_rng(9)
    drift = rng.standard_normal((16, 32))
    comp = compressor(strategy, ratio=0.05, rank=2, chunk_size=64)
    plain = compressor(strategy, ratio=0.05, rank=2, chunk_size=64, error_feedback=False)
    sent = np.zeros_like(drift)
    sent_plain = np.zeros_like(drift)
    given_sum = np.zeros_like(drift)
    norms = []
    for _ in range(400):
        x = drift + rng.standard_normal(drift.shape)
        given_sum += x
        sent += decompress(comp.compress("g", x))
        sent_plain += decompress(plain.compress("g", x))
        residual = comp.residual("g")
        assert residual is not None
        norms.append(float(np.linalg.norm(residual)))
    assert np.allclose(given_sum - sent, residual.reshape(drift.shape), atol=1e-8)
    assert max(norms[200:]) <= 2 * max(norms[:200]) + 1e-12  # bounded, not growing
    tracking = np.linalg.norm(given_sum - sent) / np.linalg.norm(given_sum)
    assert tracking < 0.1, f"{strategy.name}: sent sum is {tracking:.1%} off the input sum"
    # Without feedback the errors pile up (biased compressors) or at best
    # average out (fp16, bf16, int8 rounding; unbiased random-k).
    assert plain.residual("g") is None
    untracked = np.linalg.norm(given_sum - sent_plain) / np.linalg.norm(given_sum)
    assert untracked > 3 * tracking, (strategy.name, untracked, tracking)


# -- reduction -----------------------------------------------------------------

@pytest.mark.parametrize("strategy", list(S))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_aggregate_is_the_sum_of_decompressions(strategy: CompressionStrategy, world: int) -> None:
    rng = np.random.default_rng(world)
    ranks = [compressor(strategy, ratio=0.1, rank=2, chunk_size=32) for _ in range(world)]
    for step in range(3):
        shared = rng.standard_normal((20, 30)) * 10  # big shared entries: TopK indices overlap
        parts = [r.compress("w", (shared * (shared > 15) + rng.standard_normal((20, 30)))
                            .astype(np.float32)) for r in ranks]
        expected = sum(decompress(p).astype(np.float32) for p in parts)
        assert np.array_equal(aggregate(parts), expected)
        assert np.allclose(aggregate(parts, average=True), expected / world, rtol=1e-6)
        if strategy is S.TOPK and world > 1 and step == 0:
            common = set.intersection(*(set(p.indices.tolist()) for p in parts))  # type: ignore[union-attr]
            assert common, "the test wants ranks whose TopK indices overlap"


def test_aggregate_dequantizes_before_adding() -> None:
    """Two ranks' int8 codes under different scales: adding the codes (or
    the packed signs) would be wrong; aggregate adds what they stand for."""
    a = compressor(S.INT8).compress("g", np.array([1.0, 2.0], dtype=np.float32))
    b = compressor(S.INT8).compress("g", np.array([100.0, -50.0], dtype=np.float32))
    assert np.allclose(aggregate([a, b]), [101.0, -48.0], rtol=0.01)
    summed_codes = (a.values.astype(np.int32) + b.values) * a.scales[0]  # type: ignore[index]
    assert not np.allclose(summed_codes, [101.0, -48.0], rtol=0.1)


def test_aggregate_refuses_mismatched_or_malformed_parts() -> None:
    x = np.ones(10, dtype=np.float32)
    with pytest.raises(PMetalValueError, match="at least one"):
        aggregate([])
    with pytest.raises(PMetalValueError, match="every rank must send the same tensor"):
        aggregate([compressor(S.TOPK).compress("g", x),
                   compressor(S.TOPK).compress("g", np.ones(11, dtype=np.float32))])
    good = compressor(S.TOPK, ratio=0.3).compress("g", np.arange(10, dtype=np.float32))
    for indices in ([7, 8, 10], [9, 8, 7], [-1, 8, 9], [8, 8, 9]):
        bad = dataclasses.replace(good, indices=np.array(indices, dtype=np.int32))
        with pytest.raises(PMetalValueError, match="strictly increasing within 0..9"):
            aggregate([good, bad])
    wraps = dataclasses.replace(good, indices=np.array([9, 8, 9], dtype=np.uint64))
    with pytest.raises(PMetalValueError, match="strictly increasing"):  # no unsigned wrap
        aggregate([wraps])
    int8 = compressor(S.INT8).compress("g", x)
    with pytest.raises(PMetalValueError, match="expected 10 payload bytes and 1 scales"):
        decompress(dataclasses.replace(int8, values=int8.values[:5]))
    with pytest.raises(PMetalValueError, match="payload must be int8, not int16"):
        decompress(dataclasses.replace(int8, values=int8.values.astype(np.int16)))
    floats = dataclasses.replace(good, indices=good.indices.astype(np.float64))  # type: ignore[union-attr]
    with pytest.raises(PMetalValueError, match="indices \\(integers\\)"):
        aggregate([floats])
    dense = compressor(S.FP16).compress("g", x)
    with pytest.raises(PMetalValueError, match="9 values for 10 elements"):
        decompress(dataclasses.replace(dense, values=dense.values[:9]))


# -- PowerSGD --------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_powersgd_two_all_reduces_recover_a_low_rank_sum(world: int) -> None:
    """Gradients sharing a rank-2 column space are summed exactly by rank-2
    PowerSGD in one step: P spans that space, and P^ P^T fixes it."""
    rng = np.random.default_rng(10 + world)
    basis = rng.standard_normal((40, 2))
    grads = [(basis @ rng.standard_normal((2, 60))).reshape(40, 6, 10).astype(np.float32)
             for _ in range(world)]
    ranks = [compressor(S.POWERSGD, rank=2, seed=3) for _ in range(world)]
    p_sum = sum(r.powersgd_p("w", g) for r, g in zip(ranks, grads, strict=True))
    q_sum = sum(r.powersgd_q("w", p_sum) for r in ranks)
    results = [r.powersgd_finish("w", q_sum) for r in ranks]
    for result in results:
        assert result.shape == (40, 6, 10) and result.dtype == np.float32
        assert np.array_equal(result, results[0])  # identical on every rank
        assert np.allclose(result, sum(grads), atol=1e-3)
    for r in ranks:
        assert np.abs(r.residual("w")).max() < 1e-3  # type: ignore[arg-type]
    stats = ranks[0].statistics()
    assert stats.bytes_out == 4 * 2 * (40 + 60) and stats.bytes_in == 4 * 2400


def test_powersgd_refuses_out_of_order_calls_and_thin_tensors() -> None:
    comp = compressor(S.POWERSGD, rank=4)
    with pytest.raises(PMetalValueError, match="before powersgd_p"):
        comp.powersgd_q("w", np.zeros((10, 4)))
    p = comp.powersgd_p("w", np.ones((10, 20), dtype=np.float32))
    with pytest.raises(PMetalValueError, match="before powersgd_q"):
        comp.powersgd_finish("w", np.zeros((20, 4)))
    with pytest.raises(PMetalValueError, match=r"shape \(10, 3\), expected \(10, 4\)"):
        comp.powersgd_q("w", p[:, :3])
    assert not comp.powersgd_eligible((100,)) and not comp.powersgd_eligible((6, 6))
    with pytest.raises(PMetalValueError, match="all-reduce it uncompressed"):
        comp.powersgd_p("b", np.ones(100, dtype=np.float32))
    assert comp.compress("b", np.ones(100, dtype=np.float32)).strategy is S.NONE
    with pytest.raises(PMetalValueError, match="configured with CompressionStrategy.POWERSGD"):
        compressor(S.TOPK).powersgd_q("w", p)


# -- MLX at the boundary ------------------------------------------------------------

def test_mlx_arrays_are_converted_at_the_boundary() -> None:
    mx = pytest.importorskip("mlx.core")
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    for array in (mx.array(x), mx.array(x).astype(mx.bfloat16)):
        y = decompress(compressor(S.BF16).compress("g", array))
        assert isinstance(y, np.ndarray) and y.dtype == np.float32
        assert np.allclose(y, x, rtol=2.0 ** -7)


# -- convergence: data-parallel training through the compressors ---------------------

FEATURES, CLASSES, SAMPLES, WORKERS = 1024, 10, 512, 4
STEPS, LEARNING_RATE, L2 = 300, 0.5, 1e-3


def shards() -> tuple[np.ndarray, np.ndarray]:
    """Softmax-regression data from a random teacher with Gumbel label noise,
    split into one shard per worker."""
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((FEATURES, CLASSES)) * 3 / math.sqrt(FEATURES)
    x = rng.standard_normal((WORKERS * SAMPLES, FEATURES)).astype(np.float32)
    labels = (x @ teacher + rng.gumbel(size=(len(x), CLASSES))).argmax(axis=1)
    return x.reshape(WORKERS, SAMPLES, FEATURES), labels.reshape(WORKERS, SAMPLES)


def loss_and_gradients(params: dict[str, np.ndarray], x: np.ndarray,
                       labels: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    logits = x @ params["w"] + params["b"]
    logits -= logits.max(axis=1, keepdims=True)
    prob = np.exp(logits)
    prob /= prob.sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    loss = -np.log(prob[rows, labels]).mean() + L2 / 2 * float((params["w"] ** 2).sum())
    prob[rows, labels] -= 1
    prob /= len(labels)
    return float(loss), {"w": x.T @ prob + L2 * params["w"], "b": prob.sum(axis=0)}


def train(config: CompressionConfig) -> tuple[float, int, int]:
    """Data-parallel SGD: each worker's gradient goes through its own
    compressor; every step applies the mean of the decompressed gradients
    (aggregate, as each rank would after an all-gather). Returns the final
    training loss, gradient bytes before and after compression."""
    x, labels = shards()
    params = {"w": np.zeros((FEATURES, CLASSES), np.float32), "b": np.zeros(CLASSES, np.float32)}
    workers = [GradientCompressor(config) for _ in range(WORKERS)]
    for _ in range(STEPS):
        grads = [loss_and_gradients(params, x[i], labels[i])[1] for i in range(WORKERS)]
        for name in params:
            sent = [w.compress(name, g[name]) for w, g in zip(workers, grads, strict=True)]
            params[name] -= LEARNING_RATE * aggregate(sent, average=True)
    loss = float(np.mean([loss_and_gradients(params, x[i], labels[i])[0] for i in range(WORKERS)]))
    stats = [w.statistics() for w in workers]
    return loss, sum(s.bytes_in for s in stats), sum(s.bytes_out for s in stats)


@pytest.fixture
def one_blas_thread() -> Iterator[None]:
    """Run numpy's bundled OpenBLAS on one thread: on a shared 2-core machine
    its threads spin against other processes and made the training 10x
    slower. The figures do not depend on it; other BLAS builds are left alone."""
    found = sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas*"))
    if not found:
        yield
        return
    blas = ctypes.CDLL(str(found[0]))  # the library numpy already loaded
    before = blas.scipy_openblas_get_num_threads64_()
    blas.scipy_openblas_set_num_threads64_(1)
    try:
        yield
    finally:
        blas.scipy_openblas_set_num_threads64_(before)


@pytest.mark.usefixtures("one_blas_thread")
def test_compressed_training_matches_uncompressed_with_far_fewer_bytes() -> None:
    start = time.monotonic()
    params = FEATURES * CLASSES + CLASSES
    runs = {
        "uncompressed": CompressionConfig(),
        "topk 1% + EF": CompressionConfig(strategy=S.TOPK, ratio=0.01),
        "1-bit + EF": CompressionConfig(strategy=S.ONE_BIT),
        "topk 1%, no EF (control)": CompressionConfig(strategy=S.TOPK, ratio=0.01,
                                                      error_feedback=False),
    }
    results = {label: train(config) for label, config in runs.items()}
    base_loss, base_bytes, _ = results["uncompressed"]
    lines = [f"softmax regression, {params} parameters, {WORKERS} workers, {STEPS} steps:"]
    for label, (loss, bytes_in, bytes_out) in results.items():
        lines.append(f"  {label:26s} loss {loss:.4f} ({loss / base_loss - 1:+.2%})"
                     f"  gradient bytes {bytes_out:>10,d}  ({base_bytes / bytes_out:.1f}x fewer)")
    report = "\n".join(lines)
    print(f"\n{report}\n  ({time.monotonic() - start:.1f} s)")
    for label in ("topk 1% + EF", "1-bit + EF"):
        loss, bytes_in, bytes_out = results[label]
        assert bytes_in == base_bytes
        assert abs(loss / base_loss - 1) <= 0.02, f"{label} loss is not within 2%:\n{report}"
        assert base_bytes / bytes_out >= 30, f"{label} sends too many bytes:\n{report}"
    # Error feedback is what makes it work: the same TopK without it falls far short.
    assert results["topk 1%, no EF (control)"][0] > base_loss * 1.5, report
