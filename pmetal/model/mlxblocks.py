"""GGUF blocks rewritten in MLX's affine quantization, one matrix at a time.

What it owns: :func:`convert`, which turns one
:class:`~pmetal.model.kernels.QMatrix` into an :class:`Affine` (the arrays
``mx.quantize`` returns: packed ``uint32`` codes, per-group ``scales`` and
``biases``, ``w = scale * q + bias``) or a :class:`Dense` matrix, in
vectorized numpy and without importing ``mlx``; :mod:`pmetal.model.mlx` turns
the result into MLX arrays.

MLX's layout, checked with ``mx.quantize`` and ``mx.dequantize`` on
``mlx`` 0.32 (affine mode supports 2, 3, 4, 5, 6 and 8 bits, groups of 32, 64
or 128, scales of the input's dtype): a row's codes form one little-endian
bit stream, code ``i`` in bits ``[i * bits, (i + 1) * bits)``, read as
``uint32`` words, so a code may straddle two words at 5 and 6 bits.

=========  ===========================================  ======================
GGUF type  MLX form (groups of 32)                      exact?
=========  ===========================================  ======================
Q4_0       4 bits, scale ``d``, bias ``-8d``            yes
Q4_1       4 bits, scale ``d``, bias ``m``              yes
Q5_0       5 bits, scale ``d``, bias ``-16d``           yes
Q5_1       5 bits, scale ``d``, bias ``m``              yes
Q8_0       8 bits, code ``q + 128``, bias ``-128d``     yes
Q4_K       4 bits, scale ``d*sc``, bias ``-dmin*m``     yes
Q5_K       5 bits, scale ``d*sc``, bias ``-dmin*m``     yes
Q6_K       float16 matrix                               to float16 rounding
F16, BF16  float16, bfloat16 matrix                     yes
F32        float32 matrix                               yes
others     refused when loaded (no kernel reads them)
=========  ===========================================  ======================

"Exact" means ``scale * q + bias`` in float32 is the value ``gguf``'s
dequantizer computes, bit for bit: every product on the way (``d * sc``,
``d * q``) fits float32's 24-bit significand, so the one rounding left is
the final sum, the same one ``gguf`` makes (none at all for Q4_0 and Q8_0,
whose values fit float32 whole, and Q5_0, whose ``d * q - 16d`` is
``d * (q - 16)`` exactly). Scales and biases are stored
float16 when every one of a matrix's survives the round trip (Q4_0, Q4_1,
Q5_0, Q5_1 and Q8_0 in practice: 5 bits a weight at 4 bits, 6 at 5), float32 otherwise (the K
quants, whose ``d * sc`` needs up to 17 significant bits: 6 bits a weight
at 4 bits, against 4.5 in the file).

Q6_K has 16-element sub-blocks, each with its own scale, and MLX has no
group of 16, so no MLX form holds it exactly. The two candidates, measured
on Q6_K blocks of Gaussian weights against the values ``gguf`` decodes
(``tests/model/test_mlx_engine.py``):

====================  =============  =========  ==============
form                  bits a weight  RMS error  of Q6_K's own
====================  =============  =========  ==============
float16               16             2.0e-4     1%
8 bits, groups of 32  9-10           4.8e-3     25%
====================  =============  =========  ==============

(errors relative to the weights' RMS; "of Q6_K's own" compares with the
error Q6_K itself made quantizing those weights, 1.9e-2). float16 rounds
each weight by at most 2**-11 of itself; 8-bit requantization adds a
quarter of Q6_K's own error, on the matrices a mixed file keeps at Q6_K
because they are the sensitive ones (the LM head, half of ``attn_v`` and
``ffn_down`` in Q4_K_M). Q6_K becomes float16, at 2.4 times its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from pmetal.errors import PMetalValueError
from pmetal.model import kernels
from pmetal.model.kernels import QMatrix

__all__ = ["GROUP", "Affine", "Dense", "convert", "pack"]

GROUP = 32
F32 = np.float32
# Rows converted at once: bounds the temporaries (a byte per weight for the
# codes, ``bits`` bytes per weight while 5- and 6-bit codes are packed).
_CHUNK_WEIGHTS = 1 << 22


@dataclass(frozen=True)
class Affine:
    """A matrix ``(rows, cols)`` in MLX's affine quantization: ``w`` packed
    ``uint32 (rows, cols * bits / 32)``, ``scales`` and ``biases``
    ``(rows, cols / GROUP)`` float16 or float32."""

    w: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    rows: int
    cols: int
    exact: ClassVar[bool] = True  # every converted type is


@dataclass(frozen=True)
class Dense:
    """A matrix kept unquantized: ``array`` float16 or float32, or the
    ``uint16`` bits of a bfloat16 matrix when ``bfloat16``."""

    array: np.ndarray
    rows: int
    cols: int
    bfloat16: bool = False
    exact: bool = True


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``q`` (uint8 ``(rows, cols)``, each below ``2**bits``) as MLX's
    ``uint32`` words: one little-endian bit stream per row."""
    rows, cols = q.shape
    if cols * bits % 32:
        raise PMetalValueError(f"{cols} codes of {bits} bits do not fill whole uint32 words")
    if bits == 8:
        packed = q
    elif bits == 4:
        packed = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))
    else:
        stream = (q[:, :, None] >> np.arange(bits, dtype=np.uint8)) & np.uint8(1)
        packed = np.packbits(stream.reshape(rows, cols * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4")


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(F32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """4-bit codes of ``qs`` (blocks, bytes): each run of ``run`` bytes holds
    ``run`` codes in its low nibbles, then ``run`` in its high ones."""
    n = qs.shape[0]
    split = qs.reshape(n, -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (split & np.uint8(0x0F)).reshape(n, -1)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-32 scales and biases of Q4_K/Q5_K super-blocks (the first 16 bytes)."""
    from gguf.quants import Q4_K

    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d * sc.astype(F32), -(dmin * m.astype(F32))


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[:, 0:2])
    return _nibbles(blocks[:, 2:], 16), d, F32(-8) * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(blocks[:, 4:], 16), _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])


def _q5_codes(blocks: np.ndarray, qh: int) -> np.ndarray:
    """5-bit codes of Q5_0/Q5_1 blocks: the nibbles of the 16 bytes after the
    uint32 ``qh`` at byte ``qh``, whose bit ``j`` is the fifth bit of value j."""
    n = blocks.shape[0]
    high = np.ascontiguousarray(blocks[:, qh:qh + 4]).view("<u4") >> np.arange(32, dtype=np.uint32)
    return _nibbles(blocks[:, qh + 4:], 16) | ((high & np.uint32(1)).astype(np.uint8).reshape(n, 32) << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[:, 0:2])
    return _q5_codes(blocks, 2), d, F32(-16) * d


def _q5_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _q5_codes(blocks, 4), _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[:, 0:2])
    return blocks[:, 2:] ^ np.uint8(0x80), d, F32(-128) * d  # int8 q + 128 as uint8


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, biases = _k_scales(blocks)
    return _nibbles(blocks[:, 16:], 32), scales, biases


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, biases = _k_scales(blocks)
    n = blocks.shape[0]
    high = blocks[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = (high & np.uint8(1)).reshape(n, -1)  # sub-block i: bit i of the 32 bytes
    return _nibbles(blocks[:, 48:], 32) | (high << np.uint8(4)), scales, biases


# GGUF type -> (bits, block bytes -> (codes, scale per 32, bias per 32))
_AFFINE = {kernels.Q4_0: (4, _q4_0), kernels.Q4_1: (4, _q4_1), kernels.Q5_0: (5, _q5_0),
           kernels.Q5_1: (5, _q5_1), kernels.Q8_0: (8, _q8_0),
           kernels.Q4_K: (4, _q4_k), kernels.Q5_K: (5, _q5_k)}


def _smallest_exact(values: np.ndarray) -> np.ndarray:
    half = values.astype(np.float16)
    return half if np.array_equal(half.astype(F32), values) else values


def _affine(matrix: QMatrix) -> Affine:
    bits, split = _AFFINE[matrix.ggml_type]
    rows, cols = matrix.rows, matrix.cols  # blocks of 32 or 256: whole groups
    data = matrix.data.reshape(rows, matrix.row_bytes)
    w = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    scales = np.empty((rows, cols // GROUP), dtype=F32)
    biases = np.empty_like(scales)
    step = max(1, _CHUNK_WEIGHTS // cols)
    for first in range(0, rows, step):
        part = data[first:first + step]
        count = part.shape[0]
        blocks = part.reshape(count * matrix.row_bytes // _block_bytes(matrix), -1)
        q, s, b = split(blocks)
        w[first:first + count] = pack(q.reshape(count, cols), bits)
        scales[first:first + count] = s.reshape(count, -1)
        biases[first:first + count] = b.reshape(count, -1)
    return Affine(w=w, scales=_smallest_exact(scales), biases=_smallest_exact(biases),
                  bits=bits, rows=rows, cols=cols)


def _block_bytes(matrix: QMatrix) -> int:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(matrix.ggml_type)][1]


def _dequantized(matrix: QMatrix) -> np.ndarray:
    """``matrix`` as ``gguf`` dequantizes it, float32, in chunks of rows
    written straight to float16 (no float32 copy of the whole matrix)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(matrix.ggml_type)
    data = matrix.data.reshape(matrix.rows, matrix.row_bytes)
    out = np.empty((matrix.rows, matrix.cols), dtype=np.float16)
    step = max(1, _CHUNK_WEIGHTS // matrix.cols)
    for first in range(0, matrix.rows, step):
        part = dequantize(np.ascontiguousarray(data[first:first + step]), kind)
        out[first:first + step] = part.reshape(-1, matrix.cols)
    return out


def convert(matrix: QMatrix) -> Affine | Dense:
    """``matrix``'s weights in the form the MLX engine multiplies (see the
    table in this module's docstring)."""
    kind, rows, cols = matrix.ggml_type, matrix.rows, matrix.cols
    data = matrix.data.reshape(rows, matrix.row_bytes)
    if kind in _AFFINE:
        return _affine(matrix)
    if kind == kernels.F32:
        return Dense(np.ascontiguousarray(data).view("<f4"), rows, cols)
    if kind == kernels.F16:
        return Dense(np.ascontiguousarray(data).view("<f2"), rows, cols)
    if kind == kernels.BF16:
        return Dense(np.ascontiguousarray(data).view("<u2"), rows, cols, bfloat16=True)
    return Dense(_dequantized(matrix), rows, cols, exact=False)
