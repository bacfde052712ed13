"""The reduce operators and chunking every strategy shares."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pmetal.collectives.ops import ReduceOp, chunk_bounds, finish, reduce_into
from pmetal.errors import PMetalValueError


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_chunk_bounds_cover_the_buffer_evenly(n: int, parts: int) -> None:
    bounds = chunk_bounds(n, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    lengths = [end - start for start, end in bounds]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)   # longer first, empty last


def test_chunk_bounds_examples_and_errors() -> None:
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(PMetalValueError, match="parts must be at least 1"):
        chunk_bounds(4, 0)
    with pytest.raises(PMetalValueError, match="n_elements must be at least 0"):
        chunk_bounds(-1, 2)


@pytest.mark.parametrize("op, want", [
    (ReduceOp.SUM, [5, -1, 0]), (ReduceOp.MEAN, [5, -1, 0]), (ReduceOp.MAX, [3, 1, 0]),
    (ReduceOp.MIN, [2, -2, 0]), (ReduceOp.PRODUCT, [6, -2, 0]),
])
def test_reduce_into_is_in_place_and_keeps_the_dtype(op: ReduceOp, want: list[int]) -> None:
    for dtype in (np.float16, np.float32, np.float64, np.int32, np.int64):
        acc = np.array([2, -2, 0], dtype=dtype)
        same = reduce_into(op, acc, np.array([3, 1, 0], dtype=dtype))
        assert same is acc and acc.dtype == dtype and acc.tolist() == want


def test_reduce_into_refuses_a_different_dtype_or_shape() -> None:
    with pytest.raises(PMetalValueError, match="same shape and dtype"):
        reduce_into(ReduceOp.SUM, np.zeros(3, np.float32), np.zeros(3, np.float64))
    with pytest.raises(PMetalValueError, match="same shape and dtype"):
        reduce_into(ReduceOp.SUM, np.zeros(3), np.zeros(4))


def test_finish_divides_only_for_mean() -> None:
    x = np.array([7.0, -3.0], dtype=np.float32)
    assert finish(ReduceOp.MEAN, x, 2).tolist() == [3.5, -1.5] and x.dtype == np.float32
    i = np.array([7, -3], dtype=np.int32)
    assert finish(ReduceOp.MEAN, i, 2).tolist() == [3, -2]      # floor division
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT):
        assert finish(op, np.array([7, -3]), 2).tolist() == [7, -3]
    assert finish(ReduceOp.MEAN, np.array([7, -3]), 1).tolist() == [7, -3]
    with pytest.raises(PMetalValueError, match="world must be at least 1"):
        finish(ReduceOp.MEAN, x, 0)


def test_integer_sum_wraps_around_like_numpy() -> None:
    big = np.iinfo(np.int32).max
    acc = np.array([big], dtype=np.int32)
    reduce_into(ReduceOp.SUM, acc, np.array([1], dtype=np.int32))
    assert acc.tolist() == [np.iinfo(np.int32).min]
