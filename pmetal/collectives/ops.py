"""Reduction operators and the chunking of a buffer: the arithmetic every
collective strategy shares.

Pure numpy, no I/O. What it owns: :class:`ReduceOp` (the operators a
collective can apply), :func:`reduce_into` (one pairwise step, in place,
in the buffer's own dtype) and :func:`finish` (the last step, applied once
by every rank that holds a result), and :func:`chunk_bounds` (how a buffer
splits into contiguous pieces).

What it guarantees:

- Arithmetic stays in the buffer's dtype. Integers wrap around exactly as
  numpy's ``add``/``multiply`` do (``np.sum(x, axis=0, dtype=x.dtype)`` is
  the reference, not numpy's default promotion to int64); SUM, MAX, MIN and
  PRODUCT are exact for integers in any order.
- MEAN is SUM during the exchange and one division in :func:`finish` on
  every rank. A plan gives every rank the same reduced bytes before the
  division, so every rank divides the same numbers by the same ``world`` and
  ends bit-identical. Floats divide (``sum / world``); integers use floor
  division (``sum // world``, as Python's ``//`` rounds: toward minus
  infinity), so the result keeps the input's dtype the way every other
  operator does. A caller that wants a fractional mean of integers
  converts to float first.
- :func:`chunk_bounds` splits ``n`` elements into ``parts`` contiguous
  ranges whose sizes differ by at most one, larger ones first, covering
  ``[0, n)`` in order; when ``n < parts`` the trailing ranges are empty.
"""

from __future__ import annotations

import enum

import numpy as np

from pmetal.errors import PMetalValueError

__all__ = ["ReduceOp", "chunk_bounds", "finish", "reduce_into"]


class ReduceOp(enum.Enum):
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"


# MEAN accumulates as SUM: the division happens once, in finish().
_UFUNC: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.MEAN: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PRODUCT: np.multiply,
}


def reduce_into(op: ReduceOp, acc: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``acc = op(acc, x)`` elementwise, in place and in ``acc``'s dtype;
    returns ``acc``. ``x`` must have ``acc``'s shape and dtype: a silent
    cast would break "every rank bit-identical" the first time two ranks
    disagreed on a dtype."""
    if acc.shape != x.shape or acc.dtype != x.dtype:
        raise PMetalValueError(
            f"cannot reduce a {x.dtype}{list(x.shape)} array into a "
            f"{acc.dtype}{list(acc.shape)} one: every rank must pass the same "
            "shape and dtype")
    with np.errstate(over="ignore", invalid="ignore"):
        _UFUNC[op](acc, x, out=acc)
    return acc


def finish(op: ReduceOp, acc: np.ndarray, world: int) -> np.ndarray:
    """The last step of a reduction over ``world`` ranks, in place; returns
    ``acc``. Only MEAN does anything: divide (floats) or floor-divide
    (integers) by ``world``."""
    if world < 1:
        raise PMetalValueError(f"world must be at least 1, not {world}")
    if op is ReduceOp.MEAN and world > 1:
        with np.errstate(over="ignore", invalid="ignore"):
            if np.issubdtype(acc.dtype, np.integer):
                np.floor_divide(acc, acc.dtype.type(world), out=acc)
            else:
                np.divide(acc, acc.dtype.type(world), out=acc)
    return acc


def chunk_bounds(n_elements: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, end)`` ranges covering ``[0, n_elements)``,
    sizes differing by at most one (the first ``n_elements % parts`` are the
    longer ones); empty ranges at the end when ``n_elements < parts``."""
    if n_elements < 0:
        raise PMetalValueError(f"n_elements must be at least 0, not {n_elements}")
    if parts < 1:
        raise PMetalValueError(f"parts must be at least 1, not {parts}")
    base, extra = divmod(n_elements, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
