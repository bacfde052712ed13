"""The values of gradient compression: strategies, configuration, what
travels (:class:`Compressed`) and the statistics a compressor keeps."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from pmetal.errors import PMetalTypeError, PMetalValueError

__all__ = [
    "SPARSE",
    "Compressed",
    "CompressionConfig",
    "CompressionStatistics",
    "CompressionStrategy",
    "QuantizationType",
    "work_dtype",
]


class QuantizationType(enum.Enum):
    """The dense quantizers, each also a :class:`CompressionStrategy`."""

    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    ONE_BIT = "one_bit"

    @property
    def strategy(self) -> CompressionStrategy:
        return CompressionStrategy(self.value)


class CompressionStrategy(enum.Enum):
    """What a :class:`GradientCompressor` sends (table in the package docstring)."""

    NONE = "none"
    TOPK = "topk"
    RANDOM_K = "random_k"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    ONE_BIT = "one_bit"
    POWERSGD = "powersgd"

    @property
    def quantization(self) -> QuantizationType | None:
        """The quantizer this strategy is, or None (NONE, sparse, PowerSGD)."""
        try:
            return QuantizationType(self.value)
        except ValueError:
            return None

    @property
    def lossy(self) -> bool:
        return self is not CompressionStrategy.NONE


SPARSE = frozenset({CompressionStrategy.TOPK, CompressionStrategy.RANDOM_K})


@dataclass(frozen=True)
class CompressionConfig:
    """How a :class:`GradientCompressor` compresses.

    ``ratio``: fraction of elements TOPK and RANDOM_K keep, in (0, 1] (at
    least one element of a non-empty tensor is always kept). ``rank``:
    PowerSGD's factor rank. ``chunk_size``: elements sharing one scale in
    INT8 and ONE_BIT (larger chunks send fewer scales but fit outliers
    worse; 4096 keeps ONE_BIT at 31.75x on float32). ``seed``: RANDOM_K's
    index draws and PowerSGD's first Q; ranks must share it.
    """

    strategy: CompressionStrategy = CompressionStrategy.NONE
    ratio: float = 0.01
    rank: int = 4
    error_feedback: bool = True
    seed: int = 0
    chunk_size: int = 4096

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, CompressionStrategy):
            raise PMetalTypeError(
                f"compression strategy must be a CompressionStrategy, not {self.strategy!r}"
                f" (one of {', '.join(s.name for s in CompressionStrategy)})")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) \
                or not 0 < self.ratio <= 1:
            raise PMetalValueError(
                f"compression ratio must be a fraction in (0, 1], got {self.ratio!r}"
                " (0.01 keeps 1% of the elements)")
        for name, low in (("rank", 1), ("chunk_size", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PMetalValueError(
                    f"compression {name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True, eq=False)
class Compressed:
    """One compressed tensor, as it travels.

    ``values``: the payload (dtype per strategy: the input's for NONE and
    sparse, float16, uint16 bfloat16 bits, int8 codes, uint8 packed signs,
    PowerSGD's orthonormal P). ``indices``: sparse positions in the
    flattened tensor, strictly increasing. ``scales``: one per chunk of
    ``chunk_size`` elements (INT8, ONE_BIT). ``factor``: PowerSGD's Q.
    ``dtype`` and ``shape`` are the original tensor's.
    """

    name: str
    strategy: CompressionStrategy
    shape: tuple[int, ...]
    dtype: np.dtype
    values: np.ndarray
    indices: np.ndarray | None = None
    scales: np.ndarray | None = None
    factor: np.ndarray | None = None
    chunk_size: int = 0

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays on the wire."""
        return sum(a.nbytes for a in (self.values, self.indices, self.scales, self.factor)
                   if a is not None)


@dataclass(frozen=True, slots=True)
class CompressionStatistics:
    """What one compressor has sent since it was made. ``bytes_in`` counts
    the gradients as given, ``bytes_out`` what went on the wire (PowerSGD:
    P and Q; tensors it sent uncompressed, counted in ``uncompressed``, at
    full size)."""

    strategy: CompressionStrategy
    tensors: int
    uncompressed: int
    bytes_in: int
    bytes_out: int

    @property
    def ratio(self) -> float:
        """bytes_in / bytes_out (1.0 before anything was sent)."""
        return self.bytes_in / self.bytes_out if self.bytes_out else 1.0


def work_dtype(dtype: np.dtype) -> np.dtype:
    # float16 gradients accumulate their residual in float32: small
    # residuals would vanish in float16, which is the point of keeping them.
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


