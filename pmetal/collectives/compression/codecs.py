"""The pure encoders behind :mod:`pmetal.collectives.compression`.

Each function takes a flat, finite numpy array in its working precision
(float32, or float64 for float64 gradients) and returns what goes on the
wire, or takes that back to a flat array. No state, no error feedback: the
compressor in ``compression.py`` owns both. Chunked codecs (int8, one-bit)
keep one scale per ``chunk`` consecutive elements, in the working precision
(a float32 scale could underflow or overflow for float64 gradients); the
last chunk may be short.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "BF16_MAX",
    "bf16_decode",
    "bf16_encode",
    "index_dtype",
    "int8_decode",
    "int8_encode",
    "one_bit_decode",
    "one_bit_encode",
    "random_k_indices",
    "top_k_indices",
]

# Largest finite bfloat16 (0x7F7F). Larger finite values round to inf, so the
# compressor clips to it first: an inf on the wire would poison every rank.
BF16_MAX = float(np.array([0x7F7F << 16], dtype=np.uint32).view(np.float32)[0])


def bf16_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest, ties
    to even, on the upper 16 bits (what hardware and MLX do). NaN stays a
    quiet NaN of the same sign; values beyond :data:`BF16_MAX` become inf."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    bits = x32.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half to even; a carry
    # out of the mantissa correctly bumps the exponent.
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x32)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _blocks(x: np.ndarray, chunk: int) -> np.ndarray:
    """``x`` zero-padded to whole chunks, one chunk per row."""
    rows = -(-x.size // chunk)
    padded = np.zeros(rows * chunk, dtype=x.dtype)
    padded[:x.size] = x
    return padded.reshape(rows, chunk)


def int8_encode(x: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one scale per chunk: ``scale = max|x| / 127`` and ``code = round(x / scale)``, so each element is off by at most
    ``scale / 2`` (truncation would allow a whole ``scale``). An all-zero
    chunk has scale 0 and codes 0, without dividing by zero."""
    blocks = _blocks(x, chunk)
    largest = np.abs(blocks).max(axis=1, initial=0.0)
    # A chunk of subnormals would get a scale of 0 and lose everything.
    tiny = np.finfo(x.dtype).smallest_subnormal
    scales = np.where(largest > 0, np.maximum(largest / 127.0, tiny), 0).astype(x.dtype)
    divisor = np.where(scales > 0, scales, 1)
    codes = np.clip(np.rint(blocks / divisor[:, None]), -127, 127).astype(np.int8)
    return codes.reshape(-1)[:x.size], scales


def int8_decode(codes: np.ndarray, scales: np.ndarray, chunk: int, dtype: np.dtype) -> np.ndarray:
    per_element = np.repeat(scales.astype(dtype), chunk)[:codes.size]
    return codes.astype(dtype) * per_element


def one_bit_encode(x: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Signs packed eight to a byte (1 = non-negative, so 0 decodes as
    +scale) and one scale per chunk: the chunk's mean |x|, the scale
    that minimises the squared error of ``scale * sign(x)``."""
    blocks = _blocks(np.abs(x), chunk)
    counts = np.full(blocks.shape[0], chunk, dtype=np.int64)
    if counts.size:
        counts[-1] = x.size - chunk * (counts.size - 1)
    # Summed in float64 and clipped: float32 magnitudes near their maximum
    # would overflow a float32 sum, and an inf scale decodes to inf.
    means = blocks.sum(axis=1, dtype=np.float64) / counts
    scales = np.minimum(means, np.finfo(x.dtype).max).astype(x.dtype)
    return np.packbits(x >= 0), scales


def one_bit_decode(bits: np.ndarray, scales: np.ndarray, chunk: int, size: int,
                   dtype: np.dtype) -> np.ndarray:
    signs = np.unpackbits(bits, count=size).astype(dtype) * 2 - 1
    return signs * np.repeat(scales.astype(dtype), chunk)[:size]


def index_dtype(size: int) -> type[np.integer]:
    """int32 indices while they fit, int64 beyond 2**31 - 1 elements."""
    return np.int32 if size <= np.iinfo(np.int32).max else np.int64


def top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """The flat positions of the ``k`` largest magnitudes, ascending (ties
    broken arbitrarily, as ``argpartition`` does)."""
    if k >= x.size:
        return np.arange(x.size, dtype=index_dtype(x.size))
    chosen = np.argpartition(np.abs(x), x.size - k)[x.size - k:]
    return np.sort(chosen).astype(index_dtype(x.size))


def random_k_indices(rng: np.random.Generator, size: int, k: int) -> np.ndarray:
    """``k`` distinct positions drawn uniformly, ascending."""
    chosen = rng.choice(size, size=min(k, size), replace=False, shuffle=False)
    return np.sort(chosen).astype(index_dtype(size))
