"""Gradient compression with error feedback, correct under reduction.

A :class:`GradientCompressor` turns each named gradient into a
:class:`Compressed` value (what goes on the wire) and back. What each
strategy sends for ``n`` elements of a float32 gradient, and its error:

==========  ====================================  =========  ==========================
strategy    on the wire                           bytes      error per element
==========  ====================================  =========  ==========================
NONE        the values                            4n         none
FP16        float16 values (clipped to +-65504)   2n         relative 2**-11
BF16        bfloat16 as uint16, round-nearest-    2n         relative 2**-8
            even (no dependency needed)
INT8        int8 codes + float32 scale per chunk  n + 4n/c   at most scale/2 (rounding)
ONE_BIT     sign bits (np.packbits) + float32     n/8+4n/c   x - sign(x) * mean|x| of
            mean |x| per chunk                                its chunk
TOPK        the k = ceil(ratio*n) largest         8k         the n - k dropped values
            magnitudes + their int32 indices
RANDOM_K    k values at seeded random indices     8k         the n - k dropped values
POWERSGD    rank-r factors P (n0 x r), Q (m x r)  4r(n0+m)   what rank r misses
==========  ====================================  =========  ==========================

(``c`` is ``chunk_size``; indices are int64 beyond 2**31 - 1 elements;
float64 gradients send float64 values where float32 is shown.)

**Error feedback.** Every lossy strategy keeps, per tensor name, what it did
not send, ``residual = (gradient + previous residual) - decompress(sent)``,
and adds it to the next step's gradient. Nothing is lost, only delayed: the
sum of what was sent over T steps equals the sum of the gradients minus one
bounded residual, which is why biased compressors (TopK, 1-bit) converge like
plain SGD (Stich et al. 2018; Karimireddy et al., EF-SGD, 2019). Random-k is
sent unscaled (biased, contractive) with error feedback, and scaled by n/k
(unbiased in expectation, higher variance) without it.

**Reducing correctly.** Encoded bytes are never summed: int8 codes with
different scales, sign bits, or index/value pairs whose indices differ
between ranks mean nothing added together. Ranks all-gather their
:class:`Compressed` values and each computes :func:`aggregate`, which adds
the decompressed tensors (sparse pairs scattered and added, quantized values
dequantized first) in the order given, so every rank that passes the list
in rank order gets bit-identical sums. PowerSGD instead uses two
all-reduces of dense factors (see :mod:`pmetal.collectives.compression.powersgd`)::

    p = compressor.powersgd_p(name, grad)          # all-reduce p (SUM)
    q = compressor.powersgd_q(name, p_sum)         # all-reduce q (SUM)
    grad_sum = compressor.powersgd_finish(name, q_sum)

Tensors PowerSGD cannot shrink (fewer than 2 dimensions, or factors at least
as large as the matrix: ``compressor.powersgd_eligible(shape)`` is False)
are sent uncompressed (:meth:`GradientCompressor.compress` returns NONE).

**Inputs.** Floating numpy arrays (float16, float32, float64) of any shape,
including empty ones; MLX arrays are converted at the boundary (bfloat16 via
float32) and results are numpy. Lossy strategies refuse NaN and inf with
:class:`~pmetal.errors.PMetalValueError` and leave their state untouched, so
a caller can skip the step (as a loss scaler does); error feedback would
otherwise carry the NaN into every later step. A gradient whose sum with its
residual, or whose compressed form, overflows its dtype is refused the same
way (``reset(name)`` drops the residual). NONE passes anything through.

A compressor is not thread-safe: one per training loop. ``nbytes`` counts
the arrays on the wire, not the few bytes of name, shape and dtype.
"""

from __future__ import annotations

from pmetal.collectives.compression.base import (
    Compressed,
    CompressionConfig,
    CompressionStatistics,
    CompressionStrategy,
    QuantizationType,
)
from pmetal.collectives.compression.compressor import GradientCompressor
from pmetal.collectives.compression.reduce import aggregate, decompress

__all__ = [
    "Compressed",
    "CompressionConfig",
    "CompressionStatistics",
    "CompressionStrategy",
    "GradientCompressor",
    "QuantizationType",
    "aggregate",
    "decompress",
]
