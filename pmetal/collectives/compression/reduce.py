"""Turning :class:`Compressed` values back into tensors, one at a time or
summed across ranks, always decompressing before adding."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pmetal.collectives.compression import codecs, powersgd
from pmetal.collectives.compression.base import (
    SPARSE,
    Compressed,
    CompressionStrategy,
    work_dtype,
)
from pmetal.errors import PMetalValueError

__all__ = ["aggregate", "decompress"]

_PAYLOAD_DTYPES = {
    CompressionStrategy.FP16: np.float16,
    CompressionStrategy.BF16: np.uint16,
    CompressionStrategy.INT8: np.int8,
    CompressionStrategy.ONE_BIT: np.uint8,
}


def _check(c: Compressed) -> None:
    """Refuse a malformed value (from a faulty or hostile peer) with a clear
    error instead of an IndexError deep in numpy."""
    def bad(why: str) -> PMetalValueError:
        return PMetalValueError(f"compressed {c.strategy.name} tensor {c.name!r} of shape"
                                f" {c.shape}: {why}")
    size = c.size
    wanted = _PAYLOAD_DTYPES.get(c.strategy)
    if wanted is not None and c.values.dtype != wanted:
        raise bad(f"payload must be {np.dtype(wanted)}, not {c.values.dtype}")
    if c.strategy in SPARSE:
        if c.indices is None or c.indices.shape != c.values.shape or c.values.ndim != 1 \
                or not np.issubdtype(c.indices.dtype, np.integer):
            raise bad("indices (integers) and values must be 1-D arrays of one length")
        if c.indices.size and (c.indices[0] < 0 or c.indices[-1] >= size
                               or np.any(c.indices[1:] <= c.indices[:-1])):
            raise bad(f"indices must be strictly increasing within 0..{size - 1}")
    elif c.strategy in (CompressionStrategy.INT8, CompressionStrategy.ONE_BIT):
        expected = size if c.strategy is CompressionStrategy.INT8 else -(-size // 8)
        chunks = -(-size // c.chunk_size) if c.chunk_size > 0 else -1
        if c.values.size != expected or c.scales is None or c.scales.size != chunks:
            raise bad(f"expected {expected} payload bytes and {chunks} scales")
    elif c.strategy is CompressionStrategy.POWERSGD:
        if len(c.shape) < 2 or c.factor is None or c.values.ndim != 2 or c.factor.ndim != 2 \
                or (c.values.shape[0], c.factor.shape[0]) != powersgd.matrix_shape(c.shape) \
                or c.values.shape[1] != c.factor.shape[1]:
            raise bad("P and Q do not match the tensor's matrix shape")
    elif c.values.size != size:
        raise bad(f"{c.values.size} values for {size} elements")


def decompress(c: Compressed) -> np.ndarray:
    """The tensor ``c`` stands for, in its original shape and dtype."""
    _check(c)
    s = c.strategy
    work = work_dtype(c.dtype)
    if s is CompressionStrategy.NONE or s is CompressionStrategy.FP16:
        flat = c.values
    elif s is CompressionStrategy.BF16:
        flat = codecs.bf16_decode(c.values)
    elif s is CompressionStrategy.INT8:
        assert c.scales is not None
        flat = codecs.int8_decode(c.values, c.scales, c.chunk_size, work)
    elif s is CompressionStrategy.ONE_BIT:
        assert c.scales is not None
        flat = codecs.one_bit_decode(c.values, c.scales, c.chunk_size, c.size, work)
    elif s in SPARSE:
        flat = np.zeros(c.size, dtype=c.dtype)
        flat[c.indices] = c.values
    else:
        assert c.factor is not None
        flat = c.values @ c.factor.T
    return np.asarray(flat).reshape(c.shape).astype(c.dtype, copy=False)


def aggregate(parts: Sequence[Compressed], *, average: bool = False) -> np.ndarray:
    """The sum (or mean) of the tensors ``parts`` stand for, one per rank:
    each is decompressed (sparse pairs scattered into place, quantized
    values dequantized) and added in the order given, in float32 (float64
    for float64 tensors), then cast to the tensors' dtype."""
    if not parts:
        raise PMetalValueError("aggregate needs at least one compressed tensor")
    first = parts[0]
    for part in parts[1:]:
        if (part.shape, part.dtype) != (first.shape, first.dtype):
            raise PMetalValueError(
                f"cannot aggregate {part.name!r} {part.shape} {part.dtype} with"
                f" {first.name!r} {first.shape} {first.dtype}: every rank must send the same tensor")
    work = work_dtype(first.dtype)
    total = np.zeros(first.size, dtype=work)
    for part in parts:
        if part.strategy in SPARSE:
            _check(part)
            total[part.indices] += part.values.astype(work)  # indices are unique
        else:
            total += decompress(part).reshape(-1).astype(work)
    if average:
        total /= len(parts)
    return total.reshape(first.shape).astype(first.dtype)
