"""GGUF blocks the ``gguf`` package cannot write, for tests.

``gguf.quants.quantize`` writes Q4_0, Q4_1, Q8_0, F16 and BF16 but not the
K quants. :func:`quantize` adds crude Q4_K, Q5_K and Q6_K encoders (ggml's
block layouts, restated from ``gguf.quants``' decoders; plain min/max
scales, not llama.cpp's search): valid blocks whose values follow the float
weights, which is all a test of a decoder needs. :func:`random_blocks`
makes valid blocks of random bits with sane (finite, small) super-block
scales.
"""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
F32 = np.float32


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block packed in 12 bytes (the inverse
    of ``gguf.quants.Q4_K.get_scale_min``)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def _k_quant(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K: (d, dmin, packed scales, codes (n, 256)) of rows of 256."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale, low = (sub.max(-1) - lo) / levels, -lo
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (low.max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(_safe_div(scale, d.astype(F32))), 0, 63)
    m = np.clip(np.round(_safe_div(low, dmin.astype(F32))), 0, 63)
    step = (d.astype(F32) * sc)[..., None]
    shift = (dmin.astype(F32) * m)[..., None]
    q = np.clip(np.round(_safe_div(sub + shift, step)), 0, levels).astype(np.uint8)
    return d, dmin, _k_scales(sc, m), q.reshape(n, 256)


def _nibbles(q: np.ndarray, run: int) -> np.ndarray:
    """Codes (n, k) as bytes: each run of 2*run codes, the first run in the
    low nibbles and the second in the high ones."""
    n = q.shape[0]
    pairs = (q & 15).reshape(n, -1, 2, run)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, -1)


def q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k_quant(x, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, _nibbles(q, 32)], axis=1)


def q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _k_quant(x, 31)
    n = q.shape[0]
    high = (q >> 4).reshape(n, 8, 32)  # sub-block i: bit i of byte l
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh.astype(np.uint8),
                           _nibbles(q, 32)], axis=1)


def q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    amax = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = amax / -32
    big = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)
    d = (big / -128).astype(np.float16)
    sc = np.clip(np.round(_safe_div(scale, d.astype(F32))), -128, 127).astype(np.int8)
    step = (d.astype(F32) * sc.astype(F32))[..., None]
    q = (np.clip(np.round(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    halves = q.reshape(n, 2, 128)
    ql = _nibbles(halves.reshape(n * 2, 128), 64).reshape(n, 128)
    high = (halves >> 4).reshape(n, 2, 4, 32)
    qh = np.bitwise_or.reduce(high << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None],
                              axis=2).reshape(n, 64)
    return np.concatenate([ql, qh.astype(np.uint8), sc.view(np.uint8), _f16_bytes(d)], axis=1)


_ENCODERS = {T.Q4_K: q4_k, T.Q5_K: q5_k, T.Q6_K: q6_k}


def quantize(x: np.ndarray, kind: T) -> np.ndarray:
    """``x`` (rows, cols) as ``kind`` blocks, uint8 (rows, row bytes)."""
    rows = x.shape[0]
    x = np.ascontiguousarray(x, dtype=F32)
    if kind in _ENCODERS:
        return _ENCODERS[kind](x.reshape(-1, 256)).reshape(rows, -1)
    return np.ascontiguousarray(gguf.quants.quantize(x, kind)).view(np.uint8).reshape(rows, -1)


def random_blocks(kind: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid ``kind`` blocks (rows, row bytes): random bits, with
    super-block scales in [1e-4, 1e-2] (no infinities, no NaN)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    n = rows * cols // block
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-2, n * 2).astype(np.float16).view(np.uint8).reshape(n, 4)
    if kind == T.Q6_K:
        data[:, -2:] = scales[:, :2]
    else:  # d and dmin lead Q4_K and Q5_K blocks
        data[:, :4] = scales
    return data.reshape(rows, -1)
